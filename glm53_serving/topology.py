"""A deployment described by one TOML file under launch/, and every process argument derived from it.

Nothing is typed twice: ports, bootstrap endpoints, router workers and the client URL all come
from one `Topology`. Validation happens at load time (dataclass `__post_init__`), so a bad file
fails before any process starts.
"""

from __future__ import annotations

import json
import math
import random
import re
import shlex
import socket
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from glm53_serving import cpu, env, tenants
from glm53_serving.admission import Capacity, Limits
from glm53_serving.validation import MAX_N, MAX_N_PD

REPO_LAUNCH_DIR = Path(__file__).resolve().parent.parent / "launch"
DEFAULT_CONFIG = REPO_LAUNCH_DIR / "cpu.toml"
# glm53-tiny: GLM-5.3's MLA+DSA (the default, launch/cpu.toml); glm53-gqa-tiny: the GQA stand-in
# kept for comparison (launch/cpu-gqa.toml).
PRESETS = ("glm53-tiny", "glm53-gqa-tiny")
DSA_PRESETS = ("glm53-tiny",)  # served with the hooks' dsa_only rows on CPU (env.CPU_DSA)
# GLM-5.x's tool calls and thinking in SGLang 0.5.23 (function_call_parser.py "glm47",
# reasoning_parser.py "glm45": the names SGLang's GLM-5 recipes use).
GLM53_PARSERS = (("--tool-call-parser", "glm47"), ("--reasoning-parser", "glm45"))
SGLANG_DEFAULT_DECODE_RESERVE = 512  # --num-reserved-decode-tokens default in sglang 0.5.23


LOCAL_NODE = "local"  # the one node of a file that names none: every process on `host`, free ports
# Where each listener of a multi-node file defaults to (SGLang's and sglang-router's own defaults),
# on its node's private address; a file that names nodes gets fixed ports, since a launcher on one
# node cannot ask another node which ports are free.
DEFAULT_PORTS = {"server": 30000, "bootstrap": 8998, "router": 8000, "router_metrics": 29000, "operator": 9100}
NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")  # a DNS label: node names become Kubernetes names


class TopologyError(ValueError):
    """A topology file that cannot be deployed as written (the message names the key and the way out)."""


def _require(ok: bool, message: str) -> None:
    # Not `assert`: these checks keep operator rights and limits sound and must hold under python -O.
    if not ok:
        raise TopologyError(message)


@dataclass(slots=True)
class ModelConf:
    preset: str | None = None  # an embedded model generated locally (PRESETS)
    path: str | None = None  # or a checkpoint directory
    served_model_name: str = "glm53"
    context_length: int | None = None
    dtype: str | None = None
    # Output tokens one request may ask for; a GLM-5.3 checkpoint defaults to model.MAX_OUTPUT_TOKENS,
    # a preset to none beyond the window.
    max_output_tokens: int | None = None

    def __post_init__(self):
        _require((self.preset is None) != (self.path is None), "model: set exactly one of preset, path")
        _require(
            self.max_output_tokens is None or self.max_output_tokens > 0,
            f"model.max_output_tokens must be positive, not {self.max_output_tokens}",
        )
        _require(self.preset is None or self.preset in PRESETS, f"model.preset must be one of {PRESETS}")
        _require(
            self.context_length is None or self.context_length > 0,
            f"model.context_length must be positive, not {self.context_length}",
        )


@dataclass(slots=True)
class NodeConf:
    """One machine of a multi-node deployment."""

    name: str
    host: str  # its private address: its processes bind it and peers reach them on it
    gpus: int = 0  # GPUs it has (device = "cuda"): servers are placed on them in file order
    ib_devices: list[str] = field(default_factory=list)  # RDMA NICs for Mooncake (--disaggregation-ib-device)

    def __post_init__(self):
        _require(NAME.fullmatch(self.name) is not None, f"nodes: {self.name!r} is not a name (a-z, 0-9, '-')")
        _require(
            bool(self.host) and self.host not in ("0.0.0.0", "::"),
            f"node {self.name}: host is the private address its internal listeners bind, not {self.host!r} "
            "(only [gateway] bind is public)",
        )
        _require(self.gpus >= 0, f"node {self.name}: gpus must be >= 0")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one process runs and listens. `port` None: a free port picked at launch (single host)."""

    name: str  # server, prefill-0, decode-1, router, gateway
    role: str  # single, prefill, decode, router, gateway
    node: str
    host: str  # the private address it binds (the gateway's client listener: [gateway] bind)
    port: int | None = None
    bootstrap_port: int | None = None  # prefill: Mooncake's bootstrap server
    base_gpu_id: int | None = None  # cuda: its first GPU on the node (--base-gpu-id)
    gpus: int = 0
    operator_port: int | None = None  # gateway: the operator's listener, on the node's private address
    metrics_port: int | None = None  # router: its Prometheus exporter

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(slots=True)
class RoleConf:
    count: int = 1
    kv_tokens: int | None = None  # the role's KV pool (--max-total-tokens); [worker] gives the default
    page_size: int | None = None  # KV page size (--page-size)
    decode_reserve: int | None = None  # decode only: --num-reserved-decode-tokens (SGLang default 512)
    max_body_bytes: int | None = None  # [worker] only: servers' body limit; default the router's payload limit
    args: list[str] = field(default_factory=list)  # extra SGLang flags for this role, verbatim
    node: str | None = None  # multi-node: the node its servers run on ([worker]: the single server's)
    port: int | None = None  # multi-node: its first server's HTTP port; server i listens on port + i
    bootstrap_port: int | None = None  # multi-node prefill: its first server's bootstrap port (+ i)

    def __post_init__(self):
        _require(self.count >= 1, "a role needs at least one server")
        for name in ("kv_tokens", "page_size"):
            v = getattr(self, name)
            _require(v is None or v > 0, f"{name} must be positive")
        _require(
            self.decode_reserve is None or self.decode_reserve >= 0,
            f"decode_reserve must be >= 0, not {self.decode_reserve}",
        )
        for flag in (
            "--max-total-tokens",
            "--page-size",
            "--num-reserved-decode-tokens",
            "--context-length",
            "--host",
            "--port",
            "--base-gpu-id",
            "--disaggregation-bootstrap-port",
            "--disaggregation-ib-device",
        ):
            _require(
                flag not in self.args,
                f"set {flag} through the topology's own keys, not args: the limits derive from them",
            )


@dataclass(slots=True)
class GatewayConf:
    max_body_bytes: int = 8 * 1024 * 1024  # larger bodies get 413 before they are read
    upstream_timeout_s: float = 600.0
    # On stop (SIGTERM, Ctrl-C) the gateway admits nothing new and lets running answers finish
    # for at most this long; then every process stops.
    drain_s: float = 30.0
    # The one public listener, "host:port" (e.g. "0.0.0.0:8080"); every other listener binds a
    # private address. Default: the deployment's host and a free port (single host only).
    bind: str | None = None
    node: str | None = None  # multi-node: where it runs
    operator_port: int | None = None  # multi-node: /metrics, on the node's private address

    def __post_init__(self):
        _require(
            self.max_body_bytes > 0 and self.upstream_timeout_s > 0 and self.drain_s >= 0,
            "[gateway] max_body_bytes and upstream_timeout_s must be positive, drain_s >= 0",
        )
        if self.bind is not None:
            host, _, port = self.bind.rpartition(":")
            _require(
                bool(host) and port.isdigit() and 0 < int(port) < 65536,
                f"[gateway] bind must be host:port (e.g. 0.0.0.0:8080), not {self.bind!r}",
            )

    def bind_address(self) -> tuple[str, int] | None:
        if self.bind is None:
            return None
        host, _, port = self.bind.rpartition(":")
        return host.strip("[]"), int(port)


# Each layer behind the gateway accepts at least what the layer in front of it forwards, so the
# outermost one is the one that answers: the router re-serialises bodies (a number or an escape
# can come out longer) and adds bootstrap fields, hence twice the gateway's body limit behind it;
# and it outlives the gateway's upstream timeout, so a slow request gets the gateway's JSON 504.
INNER_BODY_FACTOR = 2
INNER_TIMEOUT_MARGIN_S = 30.0


@dataclass(slots=True)
class AdmissionConf:
    # Advertise min(context_length, smallest KV pool) instead of refusing to start when the
    # window exceeds a pool (the incident's configuration). /v1/models reports the clamped window.
    clamp_context_to_kv: bool = False
    # Clip max_new_tokens to the budget (finish_reason "length") instead of a 400.
    clip_output: bool = False


@dataclass(slots=True)
class TenantsConf:
    # "demo": the launcher writes a tenants file with two demo tenants into the run dir and prints
    # their keys; "file": the operator's tenants file (python -m glm53_serving.tenants add);
    # "off": no authentication, one trust domain (refused unless chosen explicitly).
    mode: Literal["demo", "file", "off"] = "demo"
    file: str | None = None  # mode "file"; relative paths are relative to the topology file
    # The key that signs the gateway's tenant assertions to workers; default: a new one per run.
    assertion_key_file: str | None = None
    # The audience of those assertions ("glm53:<deployment>"); default: the topology file's name.
    # Give deployments that could share a key (staging, production) distinct names.
    deployment: str | None = None
    # Every tenant's fair share at the gateway (gateway/fair_share.py: concurrent,
    # requests_per_minute, prompt_tokens_per_minute, queue_wait_s; 0 or absent: unlimited); a
    # tenant's own `limits` table in the tenants file overrides it.
    limits: dict = field(default_factory=dict)

    def __post_init__(self):
        _require(self.mode in ("demo", "file", "off"), f"tenants.mode must be demo, file or off, not {self.mode!r}")
        _require((self.mode == "file") == (self.file is not None), 'tenants: set file exactly when mode = "file"')
        try:
            tenants.TenantLimits().over(self.limits)
        except tenants.TenantsError as e:
            raise TopologyError(f"[tenants.limits]: {e}") from None
        _require(
            self.deployment is None or re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", self.deployment) is not None,
            f"tenants.deployment: {self.deployment!r} is not a name (letters, digits, '.', '_', '-')",
        )


# Always on the router's command line: one tenant's failing requests must not make the router
# refuse everyone. Its circuit breaker counts a worker's 5xx (a kv_isolation_violation, say) and
# then answers every tenant 503 for about a minute; its retries re-send a non-idempotent
# generation up to 5 times. Dead workers are still taken out by the router's health checks.
ROUTER_SHARED_FATE_OFF = ("--disable-circuit-breaker", "--disable-retries")
# A dead worker is out of the rotation within about ROUTER_DEAD_WORKER_S, not after 3 minutes
# (SGLang's default: a check every 60 s, 3 failures): until then the router would still send it
# requests whose prefill half waits out SGLang's bootstrap timeout (300 s) for a decode that is
# gone (the router joins both halves). A live server answers /health at once, busy or not.
ROUTER_HEALTH = ("--health-check-interval-secs", "2", "--health-failure-threshold", "2")
ROUTER_DEAD_WORKER_S = 6.0
# SGLang's defaults, set explicitly: a PD decode checks each prefill's bootstrap server every 5 s
# and drops it (its cached endpoints, and the requests waiting on it) after 2 misses.
PD_HEARTBEAT = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "5", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2"}
# A server keeps an idle connection open longer than its clients' pools keep it (sglang-router
# pools for 50 s; SGLang's own default closes after 5 s): otherwise a client sends on a connection
# the server is just closing. The isolation suite's thorough run met it: 4 of 43 calls' prefill
# halves failed with "error sending request" after an idle gap, and their decode halves waited
# out the 300 s bootstrap timeout (sglang issue 20851; smg PR 2162 fixes it router-side later).
SERVER_KEEP_ALIVE = {"SGLANG_TIMEOUT_KEEP_ALIVE": "120"}


@dataclass(slots=True)
class RouterConf:
    policy: str = "round_robin"
    max_payload_bytes: int | None = None  # --max-payload-size; default INNER_BODY_FACTOR x the gateway's
    request_timeout_s: float | None = None  # --request-timeout-secs; default gateway's + INNER_TIMEOUT_MARGIN_S
    args: list[str] = field(default_factory=list)
    node: str | None = None  # multi-node: where it runs
    port: int | None = None  # multi-node: its HTTP port (the gateway's upstream)
    metrics_port: int | None = None  # multi-node: its Prometheus exporter

    def __post_init__(self):
        for flag in ("--max-payload-size", "--request-timeout-secs"):
            _require(
                flag not in self.args, f"set {flag} through [router] max_payload_bytes / request_timeout_s, not args"
            )
        for arg in self.args:
            _require(
                arg not in ROUTER_HEALTH[::2],
                f"router {arg}: the launcher sets the health checks (ROUTER_HEALTH), so a dead worker leaves "
                "the rotation in seconds",
            )
            _require(
                not arg.startswith(("--retry-", "--cb-")),
                f"router {arg}: the launcher always runs the router without retries and without a circuit breaker "
                "(ROUTER_SHARED_FATE_OFF); a retry or breaker setting would let one tenant's failures refuse others",
            )


@dataclass(slots=True)
class Topology:
    topology: Literal["single", "pd"]
    model: ModelConf
    device: Literal["cpu", "cuda"] = "cuda"
    host: str = "127.0.0.1"
    transfer_backend: str = "mooncake"
    worker: RoleConf = field(default_factory=RoleConf)  # flags common to every server
    prefill: RoleConf = field(default_factory=RoleConf)
    decode: RoleConf = field(default_factory=RoleConf)
    router: RouterConf = field(default_factory=RouterConf)
    admission: AdmissionConf = field(default_factory=AdmissionConf)
    gateway: GatewayConf = field(default_factory=GatewayConf)
    tenants: TenantsConf = field(default_factory=TenantsConf)
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 600.0
    # How often the launcher restarts one child that dies after the deployment was ready (with the
    # same command line and port; a restarted server's KV pool starts empty and zeroed) before it
    # stops the whole deployment. 0: the first death stops everything. Each restart is a line of
    # restarts.jsonl in the run dir, and ready.json is rewritten with the new pid.
    restart_limit: int = 3
    # The machines, when there is more than one ([[nodes]]); each role then names its node and
    # `python -m glm53_serving.launch --node NAME` starts that node's processes only.
    nodes: list[NodeConf] = field(default_factory=list)
    gpu: str | None = None  # the GPU model (e.g. "H200"): the capacity planner knows its memory
    gpu_memory_gib: float | None = None  # or its memory per GPU, when the planner does not know the model
    source: str = "<inline>"

    def __post_init__(self):
        _require(self.topology in ("single", "pd"), f"topology must be single or pd, not {self.topology!r}")
        _require(self.device in ("cpu", "cuda"), f"device must be cpu or cuda, not {self.device!r}")
        _require(self.worker.count == 1, "[worker] holds flags shared by all servers; set counts per role")
        _require(self.ready_timeout_s > 0, f"ready_timeout_s must be positive, not {self.ready_timeout_s}")
        _require(self.restart_limit >= 0, f"restart_limit must be 0 or more, not {self.restart_limit}")
        # The deployment-wide request limit is computed from every role's KV budget; without one
        # the gateway could not start (it refuses to serve without limits), after the servers loaded.
        if self.topology == "pd":
            for role in ("prefill", "decode"):
                _require(
                    self.role_value(role, "kv_tokens"),
                    f"PD needs every role's KV budget: set kv_tokens in [{role}] or [worker] "
                    "(the deployment-wide request limit is computed from them)",
                )
        else:
            _require(
                self.worker.kv_tokens,
                "a single server needs its KV budget: set kv_tokens in [worker] ([prefill] and [decode] are "
                "read in PD only; the request limit is computed from it)",
            )
        _require(self.model.context_length, "model.context_length: the advertised window must be explicit")
        _require(
            self.prefill.max_body_bytes is None and self.decode.max_body_bytes is None,
            "max_body_bytes is one limit for every server: set it in [worker]",
        )
        gateway, router, worker = self.body_limits()
        _require(
            gateway <= router <= worker,
            f"body limits must grow inward so the gateway answers first: gateway {gateway} <= router {router} "
            f"<= worker {worker}",
        )
        _require(
            self.router_timeout_s() > self.gateway.upstream_timeout_s,
            "[router] request_timeout_s must exceed [gateway] upstream_timeout_s so the gateway answers first",
        )
        _require(self.gpu_memory_gib is None or self.gpu_memory_gib > 0, "gpu_memory_gib must be positive")
        if self.nodes:
            self._check_nodes()
        else:
            for what, conf in self._placed_confs():
                _require(
                    conf.node is None and getattr(conf, "port", None) is None,
                    f"{what}: node and port are set per node; this file names no [[nodes]] (a single-host file "
                    "picks free ports on `host`)",
                )

    def _placed_confs(self):
        return [
            ("[worker]", self.worker),
            ("[prefill]", self.prefill),
            ("[decode]", self.decode),
            ("[router]", self.router),
            ("[gateway]", self.gateway),
        ]

    def _check_nodes(self) -> None:
        names = [n.name for n in self.nodes]
        _require(len(set(names)) == len(names), f"[[nodes]]: node names must be unique, not {names}")
        for what, conf in self._placed_confs():
            if conf.node is not None:
                _require(conf.node in names, f"{what} node = {conf.node!r}: no such node (nodes: {', '.join(names)})")
        needs = (
            ["[router]", "[prefill]", "[decode]", "[gateway]"] if self.topology == "pd" else ["[worker]", "[gateway]"]
        )
        for what, conf in self._placed_confs():
            if what in needs:
                _require(conf.node is not None, f"{what}: a multi-node file places every process: set node")
        _require(
            self.gateway.bind is not None,
            '[gateway] bind: a multi-node deployment needs the public address clients use (e.g. "0.0.0.0:8080")',
        )
        _require(
            self.tenants.assertion_key_file is not None,
            "[tenants] assertion_key_file: every node must hold the same assertion key (a launcher per node "
            "would otherwise make its own); write one with python -m glm53_serving.tenants new-key FILE",
        )
        placements = self.placements()
        seen: dict[tuple[str, int], str] = {}
        for p in placements:
            for port in (p.port, p.bootstrap_port, p.operator_port, p.metrics_port):
                if port is None:
                    continue
                where = (p.host, port)
                _require(where not in seen, f"{p.name} and {seen.get(where)} both listen on {p.host}:{port}")
                seen[where] = p.name
        if self.device == "cuda":
            for node in self.nodes:
                used = sum(p.gpus for p in placements if p.node == node.name)
                _require(
                    used <= node.gpus,
                    f"node {node.name}: its servers need {used} GPUs (tp x pp each), it has {node.gpus}",
                )

    @classmethod
    def load(cls, path: Path | str, topology: str | None = None) -> Topology:
        path = Path(path)
        with path.open("rb") as f:
            raw = tomllib.load(f)
        file_topology = raw.pop("topology", "pd")
        try:
            return cls(
                topology=topology or file_topology,
                model=ModelConf(**raw.pop("model", {})),
                worker=RoleConf(**raw.pop("worker", {})),
                prefill=RoleConf(**raw.pop("prefill", {})),
                decode=RoleConf(**raw.pop("decode", {})),
                router=RouterConf(**raw.pop("router", {})),
                admission=AdmissionConf(**raw.pop("admission", {})),
                gateway=GatewayConf(**raw.pop("gateway", {})),
                tenants=TenantsConf(**raw.pop("tenants", {})),
                nodes=[NodeConf(**n) for n in raw.pop("nodes", [])],
                source=str(path),
                **raw,
            )
        except (TypeError, TopologyError) as e:
            raise ValueError(f"{path}: {e}") from e

    # --- derived -----------------------------------------------------------------------------

    def server_roles(self) -> list[str]:
        return ["single"] if self.topology == "single" else ["prefill", "decode"]

    def role_args(self, role: str) -> list[str]:
        """The SGLang flags a role's servers get verbatim: [worker]'s, then the role's own."""
        return [*self.worker.args, *(getattr(self, role).args if role in ("prefill", "decode") else ())]

    def flag_value(self, role: str, *flags: str) -> str | None:
        """The value of a flag in a role's verbatim args (the last one wins, as in argparse)."""
        args, out = self.role_args(role), None
        for i, a in enumerate(args):
            for flag in flags:
                if a == flag and i + 1 < len(args):
                    out = args[i + 1]
                elif a.startswith(flag + "="):
                    out = a.split("=", 1)[1]
        return out

    def gpus_per_server(self, role: str) -> int:
        if self.device != "cuda":
            return 0
        tp = int(self.flag_value(role, "--tp-size", "--tp") or 1)
        pp = int(self.flag_value(role, "--pp-size", "--pp") or 1)
        return tp * pp

    def node(self, name: str) -> NodeConf:
        if not self.nodes:
            return NodeConf(LOCAL_NODE, self.host)
        return next(n for n in self.nodes if n.name == name)

    def placements(self) -> list[Placement]:
        """Every process of the deployment, where it runs and listens. A single-host file (no
        [[nodes]]) puts everything on `host` with ports picked at launch; a multi-node file gets
        fixed ports (DEFAULT_PORTS unless set) and GPUs assigned per node in file order."""
        multi = bool(self.nodes)
        out: list[Placement] = []
        next_gpu: dict[str, int] = {}

        def node_of(conf) -> NodeConf:
            return self.node(conf.node) if multi else self.node(LOCAL_NODE)

        def fixed(value: int | None, kind: str, i: int = 0) -> int | None:
            return None if not multi else (value if value is not None else DEFAULT_PORTS[kind]) + i

        for role in self.server_roles():
            conf = self.worker if role == "single" else getattr(self, role)
            node = node_of(conf)
            count = 1 if role == "single" else conf.count
            # Servers on one node take ports one after another: a second role on the same node
            # starts after the first role's ports unless it sets its own.
            taken = sum(1 for p in out if p.node == node.name)
            for i in range(count):
                gpus = self.gpus_per_server(role)
                base = next_gpu.get(node.name, 0) if self.device == "cuda" else None
                if self.device == "cuda":
                    next_gpu[node.name] = base + gpus
                out.append(
                    Placement(
                        name="server" if role == "single" else f"{role}-{i}",
                        role=role,
                        node=node.name,
                        host=node.host,
                        port=fixed(conf.port, "server", i if conf.port is not None else taken + i),
                        bootstrap_port=(
                            fixed(conf.bootstrap_port, "bootstrap", i if conf.bootstrap_port is not None else taken + i)
                            if role == "prefill"
                            else None
                        ),
                        base_gpu_id=base,
                        gpus=gpus,
                    )
                )
        if self.topology == "pd":
            node = node_of(self.router)
            out.append(
                Placement(
                    "router",
                    "router",
                    node.name,
                    node.host,
                    port=fixed(self.router.port, "router"),
                    metrics_port=fixed(self.router.metrics_port, "router_metrics"),
                )
            )
        node = node_of(self.gateway)
        bind = self.gateway.bind_address()
        out.append(
            Placement(
                "gateway",
                "gateway",
                node.name,
                bind[0] if bind else node.host,
                port=bind[1] if bind else None,
                operator_port=fixed(self.gateway.operator_port, "operator"),
            )
        )
        return out

    def role_value(self, role: str, name: str):
        own = getattr(getattr(self, role), name) if role in ("prefill", "decode") else None
        return own if own is not None else getattr(self.worker, name)

    def capacities(self) -> list[Capacity]:
        """The declared capacity of every role that will hold a request."""
        roles = ["single"] if self.topology == "single" else ["prefill", "decode"]
        return [self._capacity(r) for r in roles if self.role_value(r, "kv_tokens")]

    def _capacity(self, role: str) -> Capacity:
        reserve = 0
        if role == "decode":
            reserve = self.role_value(role, "decode_reserve")
            reserve = SGLANG_DEFAULT_DECODE_RESERVE if reserve is None else reserve
        return Capacity(
            role=role,
            context_length=self.model.context_length,
            kv_tokens=self.role_value(role, "kv_tokens"),
            page_size=self.role_value(role, "page_size") or 1,
            decode_reserve=reserve,
        )

    def admission_plan(self) -> tuple[int, Limits | None]:
        """(advertised context length, deployment limits) or ValueError naming the way out."""
        caps = self.capacities()
        ctx = self.model.context_length
        smallest = min((c.kv_tokens for c in caps), default=None)
        if smallest is not None and ctx > smallest:
            if not self.admission.clamp_context_to_kv:
                worst = min(caps, key=lambda c: c.kv_tokens)
                raise ValueError(
                    f"the advertised context window (model.context_length = {ctx}) exceeds the {worst.role} "
                    f"role's KV capacity ({worst.kv_tokens} tokens): the incident's configuration. Either enlarge "
                    f"the pool (kv_tokens, with the memory to back it) or advertise the capacity: set "
                    f"[admission] clamp_context_to_kv = true (the window becomes {smallest})"
                )
            ctx = smallest
            caps = [Capacity(c.role, ctx, c.kv_tokens, c.page_size, c.decode_reserve) for c in caps]
        return ctx, (Limits.of(caps, self.max_output_tokens()) if caps else None)

    def max_output_tokens(self) -> int | None:
        """What one request may ask to generate: the file's, or GLM-5.3's 128K for a checkpoint."""
        from glm53_serving import model

        m = self.model
        if m.max_output_tokens is not None:
            return m.max_output_tokens
        return model.MAX_OUTPUT_TOKENS if m.path is not None else None

    def body_limits(self) -> tuple[int, int, int]:
        """(gateway, router, worker) request body limits in bytes."""
        gateway = self.gateway.max_body_bytes
        router = self.router.max_payload_bytes or INNER_BODY_FACTOR * gateway
        return gateway, router, self.worker.max_body_bytes or router

    def router_timeout_s(self) -> float:
        return self.router.request_timeout_s or self.gateway.upstream_timeout_s + INNER_TIMEOUT_MARGIN_S

    def deployment(self) -> str:
        if self.tenants.deployment:
            return self.tenants.deployment
        stem = Path(self.source).stem if self.source != "<inline>" else ""
        return re.sub(r"[^A-Za-z0-9._-]", "-", stem).lstrip("._-")[:64] or env.DEPLOYMENT.default

    def process_env(self) -> dict[str, str]:
        out = {
            # The bootstrap server and the transfer engine advertise this address to peers;
            # left unset they advertise the first NIC's address instead of the configured host.
            "SGLANG_HOST_IP": self.host,
            env.MAX_BODY_BYTES.name: str(self.body_limits()[2]),
            env.DEPLOYMENT.name: self.deployment(),
        }
        _, limits = self.admission_plan()
        if limits is not None:
            out[env.DEPLOYMENT_LIMITS.name] = limits.to_env()
        if self.admission.clip_output:
            out[env.CLIP_OUTPUT.name] = "1"
        out.update(SERVER_KEEP_ALIVE)
        if self.topology == "pd":  # explicit, so the launcher knows when decodes drop a dead prefill
            out.update(PD_HEARTBEAT)
        if self.device == "cpu":
            out.update(cpu.ENV)
            if self.model.preset in DSA_PRESETS:
                out[env.CPU_DSA.name] = "1"
        out.update(self.env)
        return out

    def prefill_restart_delay_s(self) -> float:
        """How long after a prefill's death every decode has dropped it: max-failure missed
        heartbeats, one interval apart, each with its 3 s read timeout, and one interval more."""
        e = self.process_env()
        interval = float(
            e.get("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", PD_HEARTBEAT["SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"])
        )
        failures = int(
            e.get(
                "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",
                PD_HEARTBEAT["SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"],
            )
        )
        return max(interval, 2.0) * (max(failures, 1) + 1) + 3.0

    def server_argv(
        self, model_path: str, port: int, role: str, bootstrap_port: int | None = None, place: Placement | None = None
    ) -> list[str]:
        """One server's command line; `place` (from placements()) puts it on its node's address and GPUs."""
        m = self.model
        host = place.host if place is not None else self.host
        ctx, _ = self.admission_plan()
        argv = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            model_path,
            "--served-model-name",
            m.served_model_name,
            "--host",
            host,
            "--port",
            str(port),
            "--context-length",
            str(ctx),
        ]
        for name, flag in (("kv_tokens", "--max-total-tokens"), ("page_size", "--page-size")):
            if self.role_value(role, name) is not None:
                argv += [flag, str(self.role_value(role, name))]
        if role == "decode" and self.role_value(role, "decode_reserve") is not None:
            argv += ["--num-reserved-decode-tokens", str(self.role_value(role, "decode_reserve"))]
        if m.dtype:
            argv += ["--dtype", m.dtype]
        if place is not None and place.base_gpu_id is not None:
            argv += ["--base-gpu-id", str(place.base_gpu_id)]
        # Every OpenAI stream ends with the worker's usage figures: the gateway counts each tenant's
        # tokens from them and takes the event out where the client did not ask (gateway/usage.py).
        argv += ["--stream-response-default-include-usage"]
        if m.path is not None:
            # A GLM-5.3 checkpoint: SGLang 0.5.23's GLM-5.x parsers, unless the topology names others.
            # (The chat template is the checkpoint's own; presets have no tool or thinking tokens.)
            mine = set(self.role_args(role))
            for flag, value in GLM53_PARSERS:
                if flag not in mine:
                    argv += [flag, value]
        if self.device == "cpu":
            argv += list(cpu.SERVER_ARGS)
        if self.tenants.mode != "off" and "--skip-server-warmup" not in self.worker.args:
            # Upstream's warm-up posts to /generate without credentials (and with the fake
            # bootstrap host in PD); both are refused here. The launcher's smoke request warms up.
            argv += ["--skip-server-warmup"]
        argv += self.worker.args
        if role == "prefill":
            argv += [
                "--disaggregation-mode",
                "prefill",
                "--disaggregation-transfer-backend",
                self.transfer_backend,
                "--disaggregation-bootstrap-port",
                str(bootstrap_port),
            ]
            argv += self._ib_args(place)
            argv += self.prefill.args
        elif role == "decode":
            argv += ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", self.transfer_backend]
            argv += self._ib_args(place)
            if self.device == "cpu":
                argv += list(cpu.DECODE_ARGS)
            argv += self.decode.args
        elif role != "single":
            raise ValueError(f"unknown role {role!r}")
        return argv

    def _ib_args(self, place: Placement | None) -> list[str]:
        ib = self.node(place.node).ib_devices if place is not None and self.nodes else []
        return ["--disaggregation-ib-device", ",".join(ib)] if ib else []

    def router_argv(
        self,
        port: int,
        prometheus_port: int,
        prefills: list[tuple[str, int]],
        decodes: list[str],
        host: str | None = None,
    ) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--host",
            host or self.host,
            "--port",
            str(port),
            "--policy",
            self.router.policy,
            # Its exporter binds 0.0.0.0:29000 by default; two routers on a host then collide.
            "--prometheus-host",
            host or self.host,
            "--prometheus-port",
            str(prometheus_port),
            "--max-payload-size",
            str(self.body_limits()[1]),
            "--request-timeout-secs",
            str(math.ceil(self.router_timeout_s())),
            *ROUTER_SHARED_FATE_OFF,
            *ROUTER_HEALTH,
        ]
        for url, boot in prefills:
            argv += ["--prefill", url, str(boot)]
        for url in decodes:
            argv += ["--decode", url]
        return argv + self.router.args

    def gateway_argv(
        self,
        upstream: str,
        model_path: str,
        port: int,
        tenants_file: Path | None = None,
        operator_port: int | None = None,
        audit_log: Path | None = None,
        host: str | None = None,
        operator_host: str | None = None,
    ) -> list[str]:
        """`host`:`port` is the client listener ([gateway] bind); the operator's listener binds
        `operator_host`, the node's private address."""
        ctx, _ = self.admission_plan()
        return [
            sys.executable,
            "-m",
            "glm53_serving.gateway",
            "--upstream",
            upstream,
            "--model-path",
            model_path,
            "--served-model-name",
            self.model.served_model_name,
            "--context-length",
            str(ctx),
            "--host",
            host or self.host,
            "--port",
            str(port),
            *(
                []
                if operator_host is None or operator_host == (host or self.host)
                else ["--operator-host", operator_host]
            ),
            "--max-body-bytes",
            str(self.gateway.max_body_bytes),
            "--upstream-timeout-s",
            str(self.gateway.upstream_timeout_s),
            "--drain-s",
            str(self.gateway.drain_s),
            "--max-n",
            str(MAX_N if self.topology == "single" else MAX_N_PD),
            *([] if operator_port is None else ["--operator-port", str(operator_port)]),
            *([] if audit_log is None else ["--audit-log", str(audit_log)]),
            *(["--tenant-limits", json.dumps(self.tenants.limits)] if self.tenants.limits else []),
            *([] if tenants_file is None else ["--tenants-file", str(tenants_file)]),
        ]


_PORTS_GIVEN: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a process that binds it later. Picked outside the kernel's ephemeral
    range: in the meantime any outgoing connection on the machine may take an ephemeral port as
    its local end (seen: the router's port taken between pick and bind, 'Address already in use')."""
    low, high = _ephemeral_ports()
    below, above = range(10_000, low), range(high + 1, 65_536)
    outside = below if len(below) >= len(above) else above
    for _ in range(200 if len(outside) > 1_000 else 0):
        port = random.choice(outside)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    with socket.socket() as s:  # no room outside the ephemeral range on this machine
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, argv)])


def default_config_path() -> Path:
    return Path(env.TOPOLOGY.get() or DEFAULT_CONFIG)

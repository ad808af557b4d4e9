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
PRESETS = ("glm53-tiny", "glm53-dsa-tiny")  # glm53-dsa-tiny: GLM-5.3's MLA+DSA, opt-in (launch/cpu-dsa.toml)
DSA_PRESETS = ("glm53-dsa-tiny",)  # served with the hooks' dsa_only rows on CPU (env.CPU_DSA)
# GLM-5.x's tool calls and thinking in SGLang 0.5.23 (function_call_parser.py "glm47",
# reasoning_parser.py "glm45": the names SGLang's GLM-5 recipes use).
GLM53_PARSERS = (("--tool-call-parser", "glm47"), ("--reasoning-parser", "glm45"))
SGLANG_DEFAULT_DECODE_RESERVE = 512  # --num-reserved-decode-tokens default in sglang 0.5.23


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

    def __post_init__(self):
        _require((self.preset is None) != (self.path is None), "model: set exactly one of preset, path")
        _require(self.preset is None or self.preset in PRESETS, f"model.preset must be one of {PRESETS}")
        _require(
            self.context_length is None or self.context_length > 0,
            f"model.context_length must be positive, not {self.context_length}",
        )


@dataclass(slots=True)
class RoleConf:
    count: int = 1
    kv_tokens: int | None = None  # the role's KV pool (--max-total-tokens); [worker] gives the default
    page_size: int | None = None  # KV page size (--page-size)
    decode_reserve: int | None = None  # decode only: --num-reserved-decode-tokens (SGLang default 512)
    max_body_bytes: int | None = None  # [worker] only: servers' body limit; default the router's payload limit
    args: list[str] = field(default_factory=list)  # extra SGLang flags for this role, verbatim

    def __post_init__(self):
        _require(self.count >= 1, "a role needs at least one server")
        for name in ("kv_tokens", "page_size"):
            v = getattr(self, name)
            _require(v is None or v > 0, f"{name} must be positive")
        _require(
            self.decode_reserve is None or self.decode_reserve >= 0,
            f"decode_reserve must be >= 0, not {self.decode_reserve}",
        )
        for flag in ("--max-total-tokens", "--page-size", "--num-reserved-decode-tokens", "--context-length"):
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

    def __post_init__(self):
        _require(
            self.max_body_bytes > 0 and self.upstream_timeout_s > 0 and self.drain_s >= 0,
            "[gateway] max_body_bytes and upstream_timeout_s must be positive, drain_s >= 0",
        )


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


@dataclass(slots=True)
class RouterConf:
    policy: str = "round_robin"
    max_payload_bytes: int | None = None  # --max-payload-size; default INNER_BODY_FACTOR x the gateway's
    request_timeout_s: float | None = None  # --request-timeout-secs; default gateway's + INNER_TIMEOUT_MARGIN_S
    args: list[str] = field(default_factory=list)

    def __post_init__(self):
        for flag in ("--max-payload-size", "--request-timeout-secs"):
            _require(
                flag not in self.args, f"set {flag} through [router] max_payload_bytes / request_timeout_s, not args"
            )
        for arg in self.args:
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
    source: str = "<inline>"

    def __post_init__(self):
        _require(self.topology in ("single", "pd"), f"topology must be single or pd, not {self.topology!r}")
        _require(self.device in ("cpu", "cuda"), f"device must be cpu or cuda, not {self.device!r}")
        _require(self.worker.count == 1, "[worker] holds flags shared by all servers; set counts per role")
        _require(self.ready_timeout_s > 0, f"ready_timeout_s must be positive, not {self.ready_timeout_s}")
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
                source=str(path),
                **raw,
            )
        except (TypeError, TopologyError) as e:
            raise ValueError(f"{path}: {e}") from e

    # --- derived -----------------------------------------------------------------------------

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
        return ctx, (Limits.of(caps) if caps else None)

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
        if self.device == "cpu":
            out.update(cpu.ENV)
            if self.model.preset in DSA_PRESETS:
                out[env.CPU_DSA.name] = "1"
        out.update(self.env)
        return out

    def server_argv(self, model_path: str, port: int, role: str, bootstrap_port: int | None = None) -> list[str]:
        m = self.model
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
            self.host,
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
        # Every OpenAI stream ends with the worker's usage figures: the gateway counts each tenant's
        # tokens from them and takes the event out where the client did not ask (gateway/usage.py).
        argv += ["--stream-response-default-include-usage"]
        if m.path is not None:
            # A GLM-5.3 checkpoint: SGLang 0.5.23's GLM-5.x parsers, unless the topology names others.
            # (The chat template is the checkpoint's own; presets have no tool or thinking tokens.)
            mine = {*self.worker.args, *(getattr(self, role).args if role in ("prefill", "decode") else ())}
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
            argv += self.prefill.args
        elif role == "decode":
            argv += ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", self.transfer_backend]
            if self.device == "cpu":
                argv += list(cpu.DECODE_ARGS)
            argv += self.decode.args
        elif role != "single":
            raise ValueError(f"unknown role {role!r}")
        return argv

    def router_argv(
        self, port: int, prometheus_port: int, prefills: list[tuple[str, int]], decodes: list[str]
    ) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--host",
            self.host,
            "--port",
            str(port),
            "--policy",
            self.router.policy,
            # Its exporter binds 0.0.0.0:29000 by default; two routers on a host then collide.
            "--prometheus-host",
            self.host,
            "--prometheus-port",
            str(prometheus_port),
            "--max-payload-size",
            str(self.body_limits()[1]),
            "--request-timeout-secs",
            str(math.ceil(self.router_timeout_s())),
            *ROUTER_SHARED_FATE_OFF,
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
    ) -> list[str]:
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
            self.host,
            "--port",
            str(port),
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

"""Start a whole topology from one config: `python -m glm53_serving.launch [--topology single|pd] [--config PATH]`.

With no arguments: the embedded default (launch/cpu.toml), a PD deployment of glm53-tiny on
this machine's CPUs: one prefill server, one decode server (Mooncake over TCP) and sglang-router
in PD mode, all on 127.0.0.1.

The launcher picks free ports, starts every child in its own process group with its log in the
run directory, and waits for *real* readiness: each server's /server_info answers and reports
the glm53_serving guards active, the router's /workers lists every worker, and one real
generation through the client URL succeeds. It then prints the client URL and a curl line and
writes ready.json in the run directory. A child that dies before ready stops the others and the
launcher exits non-zero with that child's log tail; one that dies after ready is restarted, at
most restart_limit times (Supervisor.keep_alive), several at once if several die. Ctrl-C or
SIGTERM stops every child's whole process group.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil

from glm53_serving import env, k8s, tenants
from glm53_serving import plan as capacity_plan
from glm53_serving.topology import (
    LOCAL_NODE,
    ROUTER_DEAD_WORKER_S,
    Topology,
    default_config_path,
    free_port,
    shell_line,
)

LOG_TAIL_LINES = 60
PROGRESS_EVERY_S = 5.0


def say(msg: str) -> None:
    print(f"[launch] {msg}", file=sys.stderr, flush=True)


class LaunchError(RuntimeError):
    pass


class StopRequested(BaseException):
    """Ctrl-C or SIGTERM: not an error, but it must unwind through every wait."""


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    url: str
    log: Path
    proc: subprocess.Popen | None = None
    ready: bool = False
    # sglang-router colours its console log whatever the terminal (NO_COLOR is ignored): its log
    # goes through the launcher, which writes it as plain text for whoever reads it with less/grep.
    plain_log: bool = False
    note: str = "starting"
    node: str = LOCAL_NODE  # where it runs: a launcher started with --node starts only its own

    def tail(self, n: int = LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def _die_with_parent() -> None:
    # If the launcher itself is SIGKILLed, each child still gets SIGTERM (Linux PR_SET_PDEATHSIG).
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


ANSI_ESCAPE = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")


def _copy_plain(pipe, path: Path) -> None:
    with pipe, path.open("ab") as log:
        for line in pipe:
            log.write(ANSI_ESCAPE.sub(b"", line))
            log.flush()


@dataclass(slots=True)
class Restart:
    """A child coming back (Supervisor.keep_alive): dead since `t0`, started at `start_at`
    (until then its `proc` is None)."""

    child: Child
    old_pid: int
    exit_code: int
    t0: float
    start_at: float


@dataclass(slots=True)
class Supervisor:
    run_dir: Path
    children: list[Child] = field(default_factory=list)
    # What keep_alive needs to bring a child back (set by launch()): each child's readiness
    # probe, and the operator's headers for it.
    probes: dict[str, Callable[[Child, httpx.Client], bool]] = field(default_factory=dict)
    headers: Callable[[], dict[str, str]] = dict
    restarts: dict[str, int] = field(default_factory=dict)
    prefill_delay_s: float = 0.0  # topology.prefill_restart_delay_s()
    restarting: dict[str, Restart] = field(default_factory=dict)  # by child name, until it serves again

    def start(self, child: Child) -> Child:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / f"{child.name}.cmd").write_text(shell_line(child.argv, child.env) + "\n")
        with child.log.open("ab") as log:
            child.proc = subprocess.Popen(
                child.argv,
                env={**os.environ, **child.env},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if child.plain_log else log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        if child.plain_log:
            threading.Thread(target=_copy_plain, args=(child.proc.stdout, child.log), daemon=True).start()
        if child not in self.children:  # a restart keeps its place: stop() goes front door first
            self.children.append(child)
        say(f"started {child.name} (pid {child.proc.pid}), log {child.log}")
        return child

    def check_alive(self) -> None:
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                raise LaunchError(
                    f"{c.name} exited with code {c.proc.returncode} ({c.note}); last lines of {c.log}:\n{c.tail()}"
                )

    def keep_alive(self, limit: int, timeout_s: float) -> None:
        """One supervision tick (main() calls it about every second once the deployment is ready):
        restart a child that died (same command line, same port), at most `limit` times each;
        past that, or for a child without a probe, fail as check_alive does. Nothing here waits:
        a restart advances a step a tick (start, probe, the router taking it back), so a second
        death, or the prefill's restart delay, never holds up noticing or restarting another
        child. The others keep serving meanwhile: a client of the dead one gets the router's or
        the gateway's error, never a wait."""
        for c in self.children:
            if c.proc is None or c.proc.poll() is None:
                continue  # alive, or dead and waiting out its restart delay (no process)
            self._died(c, limit)
        if not self.restarting:
            return
        with httpx.Client(headers=self.headers()) as client:  # fresh credentials each tick
            for r in list(self.restarting.values()):
                self._advance(r, client, timeout_s)

    def _died(self, c: Child, limit: int) -> None:
        """`c` exited (after ready, or again while restarting): schedule its restart, or fail."""
        done = self.restarts.get(c.name, 0)
        if done >= limit or c.name not in self.probes:
            raise LaunchError(
                f"{c.name} exited with code {c.proc.returncode} ({c.note}) after {done} restart(s) "
                f"(restart_limit {limit}); last lines of {c.log}:\n{c.tail()}"
            )
        old_pid, code = c.proc.pid, c.proc.returncode
        say(f"{c.name} (pid {old_pid}) exited with code {code}: restarting it ({done + 1}/{limit})")
        _kill_group(c.proc)  # its scheduler and detokenizer must not outlive it
        # Reaped: its pid may now be anyone's. Until the restart starts it again, nothing (pids(),
        # stop()) may signal that pid or list its children as ours.
        c.proc = None
        if c.name.startswith("decode-"):
            self.abort_stranded(c.name)
        delay = 0.0
        if c.name.startswith("prefill-"):
            # Back on the same bootstrap address only once every decode has seen it gone: a
            # decode drops a prefill's cached endpoints (and fails what waits on it) after
            # missed heartbeats; one that never saw it miss keeps sending the new prefill's
            # requests to the dead one's endpoints, and both wait 300 s (seen in the suite).
            delay = self.prefill_delay_s
            say(f"{c.name} died: restarting it in {delay:g} s, once the decodes have dropped it")
        self.restarts[c.name] = done + 1
        c.ready, c.note = False, "restarting"
        now = time.monotonic()
        first = self.restarting.get(c.name)  # died again while restarting: its first death's clock
        self.restarting[c.name] = Restart(c, old_pid, code, first.t0 if first else now, now + delay)

    def _advance(self, r: Restart, client: httpx.Client, timeout_s: float) -> None:
        """One step of a restart: start it once its delay is over; then probe it; then, for a
        server, the router until it sends it requests again; then record it."""
        c, now = r.child, time.monotonic()
        if c.proc is None:  # not started again yet (_died forgot the dead process)
            if now < r.start_at:
                return
            self.start(c)
        if now - r.t0 > timeout_s:
            raise LaunchError(
                f"{c.name} not ready {timeout_s:.0f} s after it died ({c.note}); last lines of {c.log}:\n{c.tail(20)}"
            )
        if not c.ready:
            if not self.probes[c.name](c, client):
                return
            c.ready = True
            say(f"{c.name} ready after {now - r.t0:.1f} s")
        router = next((x for x in self.children if x.name == "router" and x is not c and x.ready), None)
        if router is not None and c.name.startswith(("prefill-", "decode-")):
            if not self.probes[router.name](router, client):
                return
        del self.restarting[c.name]
        event = {
            "name": c.name,
            "old_pid": r.old_pid,
            "exit_code": r.exit_code,
            "new_pid": c.proc.pid,
            "restart": self.restarts[c.name],
            "ready_s": round(now - r.t0, 1),
            "at": datetime.now(UTC).isoformat(timespec="milliseconds"),
        }
        with (self.run_dir / "restarts.jsonl").open("a") as f:
            f.write(json.dumps(event) + "\n")
        self._rewrite_ready()
        say(f"{c.name} restarted (pid {c.proc.pid}), ready after {event['ready_s']} s")

    def abort_stranded(self, decode: str) -> None:
        """A decode died: every prefill's requests fail now instead of waiting out SGLang's
        bootstrap timeout (300 s) for KV indices the dead decode will never send (the router
        answers a client only when both halves have). Again once the router has taken the
        decode out of its rotation, for those sent to it meanwhile. With several decodes this
        also fails, cleanly, the prefill requests of live ones: no prefill knows which decode a
        request is for before that decode has allocated its pages."""

        def abort() -> None:
            for p in self.children:
                if p.name.startswith("prefill-") and p.proc is not None and p.proc.poll() is None:
                    try:
                        r = httpx.post(
                            f"{p.url}/abort_request",
                            json={"rid": "", "abort_all": True},
                            headers=self.headers(),
                            timeout=10,
                        )
                        say(f"{decode} died: aborted what {p.name} held for it ({r.status_code})")
                    except httpx.HTTPError as e:
                        say(f"{decode} died: could not abort {p.name}'s requests: {e}")

        abort()
        threading.Timer(ROUTER_DEAD_WORKER_S, abort).start()

    def _rewrite_ready(self) -> None:
        """ready.json with every child's current pid (whoever reads it sees it whole)."""
        ready = self.run_dir / "ready.json"
        if not ready.exists():
            return
        info = json.loads(ready.read_text())
        pids = {c.name: c.proc.pid for c in self.children if c.proc is not None}
        for p in info["processes"]:
            p["pid"] = pids.get(p["name"], p["pid"])
        info["all_pids"], info["restarts"] = self.pids(), dict(self.restarts)
        write_ready(self.run_dir, info)

    def pids(self) -> list[int]:
        """Every process we own: the children and all their descendants."""
        out = []
        for c in self.children:
            if c.proc is None:
                continue
            out.append(c.proc.pid)
            try:
                out += [p.pid for p in psutil.Process(c.proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return out

    def stop(self, grace_s: float = 15.0, drain: tuple[str, float] | None = None) -> None:
        """Stop every child. `drain` (name, seconds): that child (the gateway) first, given that
        long to finish what it is serving while it admits nothing new."""
        if drain is not None:
            front = next((c for c in self.children if c.name == drain[0] and c.proc is not None), None)
            if front is not None and front.proc.poll() is None:
                say(f"draining {front.name}: running answers get up to {drain[1]:g} s, nothing new is admitted")
                front.proc.send_signal(signal.SIGTERM)
                try:
                    front.proc.wait(timeout=drain[1] + 10)
                except subprocess.TimeoutExpired:
                    pass
        # Collect descendants first: once a parent exits, its children are reparented and no
        # longer findable through it.
        owned = [psutil.Process(p) for p in self.pids() if psutil.pid_exists(p)]
        # SIGTERM to each child's own process, not its group: an SGLang server then stops its
        # scheduler and detokenizer itself. Signalled directly, a scheduler dies first and the server's
        # watchdog logs "scheduler_0 crashed with exit code -15" for a normal Ctrl-C.
        for c in reversed(self.children):  # front door first, then the router, then the servers
            if c.proc is not None and c.proc.poll() is None:
                try:
                    c.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        _, alive = psutil.wait_procs(owned, timeout=grace_s)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        for c in self.children:
            if c.proc is not None:
                _kill_group(c.proc)
        psutil.wait_procs(alive, timeout=5)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the child's whole process group (it leads its own session), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=5)


# --- readiness probes -------------------------------------------------------------------------


def _get_ok(child: Child, client: httpx.Client, path: str, timeout: float = 5) -> httpx.Response | None:
    """The response if `path` answers 200; otherwise None, with what it said in child.note."""
    try:
        r = client.get(f"{child.url}{path}", timeout=timeout)
    except httpx.HTTPError:
        return None
    child.note = f"{path} {r.status_code}"
    return r if r.status_code == 200 else None


def server_probe(child: Child, client: httpx.Client) -> bool:
    """Ready when /server_info answers; refuse a server on which the plugin is not active."""
    r = _get_ok(child, client, "/server_info")
    if r is None:
        return False
    status = r.json().get("glm53_serving")
    if status is None:
        raise LaunchError(
            f"{child.name}: /server_info has no glm53_serving status: the plugin did not load in this "
            "server (is glm53-serving installed in its environment, and SGLANG_PLUGINS unset or "
            "naming glm53_serving?). Refusing to serve without it."
        )
    if not status.get("active"):
        say(f"WARNING: {child.name} runs with glm53_serving guards DISABLED ({status.get('disabled_by')})")
    elif status.get("tenants") != (want := "off" if child.env.get(env.TENANTS.name) == "off" else "enforced"):
        raise LaunchError(
            f"{child.name}: tenants {status.get('tenants')!r} on the server, but {want!r} in the deployment. "
            "Refusing to serve."
        )
    return True


def router_probe(expected_workers: int) -> Callable[[Child, httpx.Client], bool]:
    def probe(child: Child, client: httpx.Client) -> bool:
        # The router answers /health before it has registered workers; /workers tells the truth.
        r = _get_ok(child, client, "/workers")
        if r is None:
            return False
        # Healthy ones: after a worker's restart the router takes it back only after its health
        # checks pass again (ROUTER_HEALTH), and until then answers 503.
        healthy = sum(bool(w.get("is_healthy")) for w in r.json().get("workers", []))
        child.note = f"{healthy}/{expected_workers} workers healthy"
        return healthy >= expected_workers

    return probe


def gateway_probe(child: Child, client: httpx.Client) -> bool:
    return _get_ok(child, client, "/health", timeout=30) is not None


def wait_ready(
    sup: Supervisor,
    pending: dict[str, Callable[[Child, httpx.Client], bool]],
    t0: float,
    timeout_s: float,
    headers: Callable[[], dict[str, str]] = dict,
    children: list[Child] | None = None,
) -> None:
    """Probe until every pending child is ready; `children` may name remote ones (other nodes)."""
    by_name = {c.name: c for c in (children if children is not None else sup.children)}
    last_progress = time.monotonic()
    with httpx.Client() as client:
        while pending:
            sup.check_alive()
            client.headers.update(headers())  # fresh credentials: start-up can outlast an assertion
            for name in list(pending):
                if pending[name](by_name[name], client):
                    by_name[name].ready = True
                    say(f"{name} ready after {time.monotonic() - t0:.1f} s")
                    del pending[name]
            if not pending:
                return
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise LaunchError(
                    f"not ready after {timeout_s:.0f} s: "
                    + ", ".join(
                        f"{n} ({by_name[n].note}); last lines of {by_name[n].log}:\n{by_name[n].tail(20)}"
                        for n in pending
                    )
                )
            if now - last_progress >= PROGRESS_EVERY_S:
                say(f"waiting {now - t0:.0f} s: " + ", ".join(f"{n} ({by_name[n].note})" for n in pending))
                last_progress = now
            time.sleep(0.5)


def smoke_generate(client_url: str, headers: dict[str, str]) -> list[int]:
    """One real greedy generation through the client URL."""
    r = httpx.post(
        f"{client_url}/generate",
        timeout=120,
        headers=headers,
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}},
    )
    if r.status_code != 200 or len(r.json().get("output_ids", [])) != 4:
        raise LaunchError(f"smoke generation through {client_url} failed: HTTP {r.status_code} {r.text[:500]}")
    return r.json()["output_ids"]


# --- the topology ------------------------------------------------------------------------------


def resolve_model_path(topo: Topology) -> str:
    if topo.model.path:
        return topo.model.path
    from glm53_serving.models import dsa_tiny, tiny

    recipe = dsa_tiny if topo.model.preset == dsa_tiny.PRESET else tiny
    path = recipe.default_path()
    if not tiny.has_checkpoint(path):
        say(f"generating {topo.model.preset} into {path}")
    return str(recipe.ensure(path))


@dataclass(slots=True)
class Tenancy:
    """The deployment's tenants: the assertion key every process shares, the gateway's tenants
    file, and (demo mode) the demo tenants' keys, also kept in the run dir (0600) for scripts."""

    key_file: Path | None = None
    tenants_file: Path | None = None  # None: tenants off (the key then signs operator tokens only)
    demo_keys: dict[str, str] = field(default_factory=dict)
    deployment: str | None = None  # the audience of its assertions (Topology.deployment)

    DEMO_TENANTS = ("demo", "demo-b")

    @classmethod
    def prepare(cls, topo: Topology, run_dir: Path, create: bool = True, demo_tenants: bool = True) -> Tenancy:
        """`demo_tenants` False: a node without the gateway (only the gateway reads the tenants file)."""
        conf = topo.tenants
        base = Path(topo.source).parent if topo.source != "<inline>" else Path.cwd()
        key_file = (base / conf.assertion_key_file) if conf.assertion_key_file else run_dir / "assertion.key"
        tenants_file = {"file": base / (conf.file or ""), "demo": run_dir / "tenants.toml"}.get(conf.mode)
        out = cls(key_file, tenants_file, deployment=topo.deployment())
        if not create:
            return out
        run_dir.mkdir(parents=True, exist_ok=True)
        if not conf.assertion_key_file:
            tenants.new_assertion_key(key_file)
        tenants.load_assertion_key(key_file)  # exists and is long enough, before anything starts
        if conf.mode == "demo" and demo_tenants:
            out.demo_keys = {t: tenants.add_tenant(tenants_file, t) for t in cls.DEMO_TENANTS}
            fd = os.open(run_dir / "demo-keys.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(out.demo_keys, f)
        if tenants_file is not None and (demo_tenants or conf.mode == "file"):
            tenants.TenantsFile.load(tenants_file)
        return out

    @property
    def on(self) -> bool:
        return self.tenants_file is not None

    def env(self) -> dict[str, str]:
        """A worker's: the key (operator routes always need the operator's assertion), and tenants
        off only when the topology says so."""
        return {tenants.KEY_FILE_ENV: str(self.key_file), **({} if self.on else {env.TENANTS.name: "off"})}

    def gateway_env(self) -> dict[str, str]:
        return {tenants.KEY_FILE_ENV: str(self.key_file)} if self.on else {}

    def admin_headers(self) -> dict[str, str]:
        return {
            "Authorization": "Bearer "
            + tenants.mint(tenants.load_assertion_key(self.key_file), tenants.ADMIN, deployment=self.deployment)
        }


@dataclass(slots=True)
class Plan:
    servers: list[Child]
    router: Child | None  # PD only
    gateway: Child  # the client endpoint of every topology
    operator_url: str  # the gateway's operator listener (/metrics): never the client port
    public_url: str  # where clients connect: [gateway] bind as written (0.0.0.0 included)

    def all(self) -> list[Child]:
        return [*self.servers, *([self.router] if self.router else []), self.gateway]

    def stages(self) -> list[list[Child]]:
        """In start order: each stage starts once every child of the earlier ones is ready."""
        return [self.servers, *([[self.router]] if self.router else []), [self.gateway]]

    def on(self, node: str | None) -> list[Child]:
        """The children that run on `node` (every child when None)."""
        return [c for c in self.all() if node is None or c.node == node]


def _reachable(host: str, node_host: str) -> str:
    # A wildcard bind is reached on the node's own address.
    return node_host if host in ("0.0.0.0", "::", "") else host


def plan(topo: Topology, model_path: str, run_dir: Path, tenancy: Tenancy) -> Plan:
    """Every child of the topology, on its node: fixed ports where the file names nodes, fresh
    free ones on a single host."""
    shared = topo.process_env()
    worker_env = {**shared, **tenancy.env()}
    places = {}
    for p in topo.placements():
        host = topo.node(p.node).host
        places[p.name] = dataclasses.replace(
            p,
            port=p.port if p.port is not None else free_port(_reachable(p.host, host)),
            bootstrap_port=(p.bootstrap_port or free_port(host)) if p.role == "prefill" else None,
            operator_port=(p.operator_port or free_port(host)) if p.role == "gateway" else None,
            metrics_port=(p.metrics_port or free_port(host)) if p.role == "router" else None,
        )

    def child(p, argv: list[str], base: dict[str, str], extra: dict[str, str] | None = None) -> Child:
        node_host = topo.node(p.node).host
        # The bootstrap server advertises SGLANG_HOST_IP to peers.
        env_ = {**base, "SGLANG_HOST_IP": node_host, **(extra or {})}
        url = f"http://{_reachable(p.host, node_host)}:{p.port}"
        return Child(p.name, argv, env_, url, run_dir / f"{p.name}.log", node=p.node)

    servers_at = [p for p in places.values() if p.role in ("single", "prefill", "decode")]
    prefills = [p for p in servers_at if p.role == "prefill"]
    # Prefill and decode accept handoffs naming these bootstrap endpoints only (intake.py).
    trusted = (
        {env.PREFILL_BOOTSTRAP.name: ",".join(f"{p.host}:{p.bootstrap_port}" for p in prefills)} if prefills else {}
    )
    servers = [
        child(
            p,
            topo.server_argv(model_path, p.port, p.role, p.bootstrap_port, p),
            worker_env,
            # Its event log (events.py): which requests it took, what its guards saw. Mooncake's
            # transfer engine advertises MC_TCP_BIND_ADDRESS (unset: its first NIC's address; its
            # listeners bind every address regardless, docs/deploy.md).
            {
                **trusted,
                env.EVENTS_LOG.name: str(run_dir / "events" / p.name),
                "MC_TCP_BIND_ADDRESS": topo.node(p.node).host,
            },
        )
        for p in servers_at
    ]
    router = None
    upstream = servers[0].url
    if "router" in places:
        r = places["router"]
        by_name = {c.name: c for c in servers}
        # The router forwards the gateway's assertions and never checks one: it gets no key.
        router = child(
            r,
            topo.router_argv(
                r.port,
                r.metrics_port,
                [(by_name[p.name].url, p.bootstrap_port) for p in prefills],
                [by_name[p.name].url for p in servers_at if p.role == "decode"],
                host=r.host,
            ),
            shared,
        )
        router.plain_log = True
        upstream = router.url
    g = places["gateway"]
    node_host = topo.node(g.node).host
    gateway = child(
        g,
        topo.gateway_argv(
            upstream,
            model_path,
            g.port,
            tenancy.tenants_file,
            g.operator_port,
            run_dir / "audit.jsonl",
            host=g.host,
            operator_host=node_host,
        ),
        {**shared, **tenancy.gateway_env()},
    )
    return Plan(servers, router, gateway, f"http://{node_host}:{g.operator_port}", f"http://{g.host}:{g.port}")


def launch(topo: Topology, run_dir: Path, sup: Supervisor, node: str | None = None) -> dict:
    """Start the topology's children on `node` (all of them when None) and wait until they are
    ready; a stage waits for the earlier stages' children wherever they run (remote workers
    included: the router's node waits for every server)."""
    t0 = time.monotonic()
    model_path = resolve_model_path(topo)
    places = topo.placements()  # where each process runs (no ports picked yet: plan() does that once)
    if not any(node is None or pl.node == node for pl in places):
        raise LaunchError(f"node {node!r} runs none of this topology's processes")
    gateway_here = node is None or next(pl for pl in places if pl.role == "gateway").node == node
    tenancy = Tenancy.prepare(topo, run_dir, demo_tenants=gateway_here)
    if topo.tenants.mode == "off":
        say('WARNING: tenants are OFF ([tenants] mode = "off"): every client shares one trust domain')
    p = plan(topo, model_path, run_dir, tenancy)
    mine = {c.name for c in p.on(node)}
    say(f"{topo.topology} topology from {topo.source}" + (f", node {node}" if node else "") + f"; run dir {run_dir}")
    probes: dict[str, Callable[[Child, httpx.Client], bool]] = {
        **{s.name: server_probe for s in p.servers},
        **({p.router.name: router_probe(len(p.servers))} if p.router else {}),
        p.gateway.name: gateway_probe,
    }
    sup.probes, sup.headers = probes, tenancy.admin_headers
    sup.prefill_delay_s = topo.prefill_restart_delay_s() if topo.topology == "pd" else 0.0
    waited: set[str] = set()
    order = [c.name for c in p.all()]
    for stage in p.stages():
        local = [c for c in stage if c.name in mine]
        if not local:
            continue
        earlier = [c for st in p.stages()[: p.stages().index(stage)] for c in st if c.name not in waited]
        if earlier:  # remote ones too: this node's processes need them
            wait_ready(
                sup, {c.name: probes[c.name] for c in earlier}, t0, topo.ready_timeout_s, tenancy.admin_headers, p.all()
            )
            waited |= {c.name for c in earlier}
        for c in local:
            if c.proc is None:
                sup.start(c)
        if p.gateway.name in mine and p.gateway.proc is None:
            # The gateway needs nothing of the upstream to start (it connects per request, and its
            # /health passes only once the upstream's does), so it starts beside the first stage:
            # its imports (SGLang's request models, ~7 s of CPU) overlap the servers' start-up
            # instead of following it. Its stage still waits for it, after the router.
            sup.start(p.gateway)
        # In plan order at every point, so that stop() (a failed start included) goes front door
        # first, servers last, whatever order they were started in.
        sup.children.sort(key=lambda c: order.index(c.name))
        wait_ready(
            sup, {c.name: probes[c.name] for c in local}, t0, topo.ready_timeout_s, tenancy.admin_headers, p.all()
        )
        waited |= {c.name for c in local}
    client_url = p.gateway.url
    if gateway_here:
        if not tenancy.on or tenancy.demo_keys:  # through the front door, as a client would
            key = next(iter(tenancy.demo_keys.values()), None)
            smoke_generate(client_url, {"Authorization": f"Bearer {key}"} if key else {})
        else:  # the operator's tenants file: we hold no tenant key; the upstream takes the admin's assertion
            smoke_generate(p.router.url if p.router else p.servers[0].url, tenancy.admin_headers())
    ready_s = time.monotonic() - t0
    info = {
        "client_url": client_url,
        "public_url": p.public_url,
        "operator_url": p.operator_url,
        "audit_log": str(run_dir / "audit.jsonl"),
        "events_dir": str(run_dir / "events"),
        "topology": topo.topology,
        "node": node,
        "serves_clients": gateway_here,  # the gateway runs here
        "model": topo.model.served_model_name,
        "ready_s": round(ready_s, 1),
        "launcher_pid": os.getpid(),
        "processes": [{"name": c.name, "pid": c.proc.pid, "url": c.url, "log": str(c.log)} for c in sup.children],
        "all_pids": sup.pids(),
        "tenants": {
            "mode": topo.tenants.mode,
            "file": str(tenancy.tenants_file) if tenancy.tenants_file and gateway_here else None,
            "assertion_key_file": str(tenancy.key_file) if tenancy.key_file else None,
            "demo_keys_file": str(run_dir / "demo-keys.json") if tenancy.demo_keys else None,
            "deployment": tenancy.deployment,  # the audience of its assertions: tenants.audience(deployment)
        },
    }
    write_ready(run_dir, info)
    return {**info, "demo_key": tenancy.demo_keys.get("demo")}


def write_ready(run_dir: Path, info: dict) -> None:
    """ready.json, at start-up and after each restart. Whoever waits for it reads it as soon as it
    exists: it appears whole, or not at all."""
    (run_dir / "ready.json.tmp").write_text(json.dumps(info, indent=2) + "\n")
    os.replace(run_dir / "ready.json.tmp", run_dir / "ready.json")


def print_ready(info: dict) -> None:
    if not info["serves_clients"]:
        names = ", ".join(p["name"] for p in info["processes"])
        print(
            f"\nnode {info['node']} ready in {info['ready_s']} s: {names}\n"
            f"  clients connect to the gateway: {info['public_url']}\n  Ctrl-C stops this node's processes.\n",
            flush=True,
        )
        return
    url, model, key = info["client_url"], info["model"], info.pop("demo_key", None)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16})
    auth = f" -H 'Authorization: Bearer {key}'" if key else ""
    keys = f"  demo tenant key (also in {info['tenants']['demo_keys_file']}): {key}\n" if key else ""
    print(
        f"\nready in {info['ready_s']} s ({info['topology']})\n"
        f"  client URL: {url}\n{keys}"
        f"  operator (metrics): {info['operator_url']}/metrics\n"
        f"  try:  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n"
        f"  Ctrl-C stops every process.\n",
        flush=True,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m glm53_serving.launch",
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"topology file (TOML); default {default_config_path()} (or $GLM53_TOPOLOGY)",
    )
    p.add_argument(
        "--topology",
        choices=("single", "pd"),
        default=None,
        help="override the file's topology: one colocated server, or prefill + decode + router",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="where logs, commands and ready.json go; default runs/<UTC time>-<topology>",
    )
    p.add_argument(
        "--node",
        default=None,
        help="a multi-node file ([[nodes]]): start only this node's processes (one launcher per node)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands it would run, start nothing")
    k8s.add_arguments(p)  # --render k8s, --out, ...
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        topo = Topology.load(args.config or default_config_path(), args.topology)
        topo.admission_plan()  # the start-up lint: refuse before starting anything
        nodes = [n.name for n in topo.nodes]
        if args.node is not None and args.node not in nodes:
            raise ValueError(f"--node {args.node}: the file's nodes are {nodes or 'none (it is single-host)'}")
        if nodes and args.node is None and not (args.dry_run or args.render):
            raise ValueError(f"this file places processes on nodes {nodes}: start each with --node NAME")
        # A CUDA role whose kv_tokens its GPUs cannot back (SGLang would shrink the pool with a
        # warning); a dry run may leave the GPU unnamed. Manifests are checked like a start.
        capacity_plan.check(topo, require_memory=not args.dry_run)
        if args.render:  # manifests for the topology instead of processes
            return k8s.render_main(topo, args, plan, Tenancy)
    except (OSError, ValueError) as e:
        say(f"bad topology: {e}")
        return 2
    suffix = f"-{args.node}" if args.node else ""
    run_dir = args.run_dir or Path("runs") / f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{topo.topology}{suffix}"
    run_dir = run_dir.resolve()
    if args.dry_run:
        p = plan(
            topo, topo.model.path or f"<{topo.model.preset}>", run_dir, Tenancy.prepare(topo, run_dir, create=False)
        )
        for n in [args.node] if args.node else (nodes or [None]):
            if n is not None:
                print(
                    f"## node {n} ({topo.node(n).host}): python -m glm53_serving.launch --config {topo.source} --node {n}"
                )
            for c in p.on(n):
                print(f"# {c.name}\n{shell_line(c.argv, c.env)}")
        print(f"# client URL: {p.public_url}")
        return 0

    def on_signal(signum, _frame):
        raise StopRequested(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    sup = Supervisor(run_dir)
    try:
        print_ready(launch(topo, run_dir, sup, args.node))
        while True:  # serve (restarting a child that dies, up to restart_limit) until told to stop
            sup.keep_alive(topo.restart_limit, topo.ready_timeout_s)
            time.sleep(0.5 if sup.restarting else 1.0)
    except StopRequested as e:
        say(f"{e}: stopping {len(sup.children)} children")
        return 0
    except LaunchError as e:
        say(f"FAILED: {e}")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sup.stop(drain=("gateway", topo.gateway.drain_s))
        say("all children stopped")


if __name__ == "__main__":
    sys.exit(main())

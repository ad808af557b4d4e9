"""Three "nodes" on three loopback addresses, one launcher per node (`--node NAME`), as on a real
cluster: prefill on 127.0.0.2, decode on 127.0.0.3, router and gateway on 127.0.0.4, and the
gateway's public bind on 127.0.0.5. Each launcher starts only its node's processes; the front
node's waits for the remote workers. A client is served through the public address, and nothing
of the deployment listens there but the gateway."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from pathlib import Path

import httpx
import psutil
import pytest

from glm53_serving import tenants
from glm53_serving.topology import free_port
from tests.e2e.deployment import MODEL, config_text, model_path
from tests.e2e.launcher import READY_TIMEOUT_S, alive, launcher_output, start

pytestmark = pytest.mark.e2e

NODES = {"prefill-node": "127.0.0.2", "decode-node": "127.0.0.3", "front": "127.0.0.4"}
PUBLIC = "127.0.0.5"


def topology_file(tmp_path: Path) -> Path:
    """The default topology's model and worker settings, placed on three nodes with fixed ports."""
    base = config_text()
    base = base.replace('host = "127.0.0.1"\n', "")
    port = {h: free_port(h) for h in NODES.values()}
    nodes = "".join(f'[[nodes]]\nname = "{n}"\nhost = "{h}"\n\n' for n, h in NODES.items())
    tenants.new_assertion_key(tmp_path / "assertion.key")
    sections = {
        "prefill": f'node = "prefill-node"\nport = {port["127.0.0.2"]}\nbootstrap_port = {free_port("127.0.0.2")}',
        "decode": f'node = "decode-node"\nport = {port["127.0.0.3"]}',
        "router": f'node = "front"\nport = {port["127.0.0.4"]}\nmetrics_port = {free_port("127.0.0.4")}',
        "gateway": f'node = "front"\nbind = "{PUBLIC}:{free_port(PUBLIC)}"\noperator_port = {free_port("127.0.0.4")}',
        "tenants": 'assertion_key_file = "assertion.key"',
    }
    placed = base
    for name, keys in sections.items():  # each [section] header line (comments included) gets the keys
        placed, n = re.subn(rf"^\[{name}\][^\n]*\n", lambda m, k=keys: m.group(0) + k + "\n", placed, flags=re.M)
        assert n == 1, name
    path = tmp_path / "three-nodes.toml"
    path.write_text(placed.replace("[model]\n", nodes + "[model]\n", 1))
    return path


def wait_ready(runs: dict[str, tuple], timeout: float = READY_TIMEOUT_S) -> dict[str, dict]:
    deadline, out = time.monotonic() + timeout, {}
    while len(out) < len(runs):
        for node, (proc, run_dir) in runs.items():
            if node in out:
                continue
            if (run_dir / "ready.json").exists():
                out[node] = json.loads((run_dir / "ready.json").read_text())
            elif proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"node {node}: launcher {proc.poll()}:\n{launcher_output(run_dir)[-4000:]}")
        time.sleep(0.5)
    return out


def listeners(pids: list[int]) -> dict[tuple[str, int], str]:
    """Every listening socket of these processes: (address, port) -> the process's command line."""
    out = {}
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            out[(c.laddr.ip, c.laddr.port)] = " ".join(psutil.Process(c.pid).cmdline()[:4])
    return out


def test_three_loopback_nodes_serve_through_the_gateway_bound_to_its_own_address(tmp_path):
    model_path()  # one generation, before three launchers look for it
    config = topology_file(tmp_path)
    runs = {}
    try:
        # The front node first: its launcher must wait for workers that do not exist yet.
        for node in ("front", "decode-node", "prefill-node"):
            run_dir = tmp_path / f"run-{node}"
            runs[node] = (start(run_dir, "--config", str(config), "--node", node), run_dir)
        ready = wait_ready(runs)
        front = ready["front"]
        assert front["serves_clients"] and not ready["prefill-node"]["serves_clients"]
        assert [p["name"] for p in ready["prefill-node"]["processes"]] == ["prefill-0"]
        assert [p["name"] for p in ready["decode-node"]["processes"]] == ["decode-0"]
        assert [p["name"] for p in front["processes"]] == ["router", "gateway"]
        assert "waiting" in launcher_output(runs["front"][1])  # it did wait for the remote workers

        # A client through the public address: greedy tokens, and the router reports the workers
        # on their own nodes' addresses.
        url = front["public_url"]
        assert url.startswith(f"http://{PUBLIC}:")
        key = json.loads(Path(front["tenants"]["demo_keys_file"]).read_text())["demo"]
        r = httpx.post(
            f"{url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": MODEL, "prompt": "Hello there", "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"]
        router = next(p["url"] for p in front["processes"] if p["name"] == "router")
        assert router.startswith("http://127.0.0.4:")

        # Nothing of ours listens on the public address but the gateway's client port: every
        # HTTP, bootstrap, router and operator listener binds its node's private address
        # (127.0.0.1: a node's own internal sockets, SGLang's ZMQ, unreachable from other hosts).
        pids = [p for info in ready.values() for p in info["all_pids"]]
        bound = listeners(pids)
        public_port = int(url.rsplit(":", 1)[1])
        exposed = {b: cmd for b, cmd in bound.items() if b[0] not in (*NODES.values(), "127.0.0.1")}
        assert exposed.pop((PUBLIC, public_port)).endswith("glm53_serving.gateway --upstream")
        # Upstream's exception: Mooncake's transfer engine (in each scheduler) binds its RPC and TCP
        # data ports on every address whatever MC_TCP_BIND_ADDRESS says (it sets only the address
        # it advertises); docs/deploy.md has the firewall rule. Anything else on a wildcard fails.
        assert all(ip in ("0.0.0.0", "::") and cmd.startswith("sglang::scheduler") for (ip, _), cmd in exposed.items())
        assert len(exposed) <= 3 * len(ready["prefill-node"]["processes"] + ready["decode-node"]["processes"])
        ours = [int(u.rsplit(":", 1)[1]) for info in ready.values() for u in [p["url"] for p in info["processes"]]]
        ours += [int(front["operator_url"].rsplit(":", 1)[1])]
        for port in ours:
            if port == public_port:
                continue
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex((PUBLIC, port)) != 0, f"port {port} answers on the public address"
    finally:
        for proc, _ in runs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        codes = {node: proc.wait(timeout=120) for node, (proc, _) in runs.items()}
    assert codes == dict.fromkeys(runs, 0), codes
    assert not alive(pids)

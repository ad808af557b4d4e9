"""Multi-node topology files: every process placed on a named node, fixed ports, GPUs assigned per
node, one public listener (the gateway's bind), and one launcher per node (`--node NAME`)."""

import subprocess
import sys

import pytest

from glm53_serving.topology import Topology

THREE_NODES = """
topology = "pd"
device = "cuda"
transfer_backend = "mooncake"
gpu_memory_gib = 288               # a 288 GB GPU: TP4 holds GLM-5.3's FP8 weights (the planner checks)

[[nodes]]
name = "prefill-a"
host = "10.0.0.11"
gpus = 8
ib_devices = ["mlx5_0", "mlx5_1"]

[[nodes]]
name = "decode-a"
host = "10.0.0.12"
gpus = 8

[[nodes]]
name = "front"
host = "10.0.0.10"

[model]
path = "/models/GLM-5.3"
context_length = 4096

[worker]
kv_tokens = 8192
args = ["--tp-size", "4", "--mem-fraction-static", "0.85"]

[prefill]
node = "prefill-a"
count = 2

[decode]
node = "decode-a"

[router]
node = "front"

[gateway]
node = "front"
bind = "0.0.0.0:8080"

[tenants]
mode = "demo"
assertion_key_file = "assertion.key"
"""


def load(tmp_path, body=THREE_NODES):
    p = tmp_path / "nodes.toml"
    p.write_text(body)
    return Topology.load(p)


def test_each_process_is_placed_on_its_node_with_fixed_ports_and_its_own_gpus(tmp_path):
    places = {p.name: p for p in load(tmp_path).placements()}
    assert [(n, p.node, p.host, p.port) for n, p in places.items()] == [
        ("prefill-0", "prefill-a", "10.0.0.11", 30000),
        ("prefill-1", "prefill-a", "10.0.0.11", 30001),
        ("decode-0", "decode-a", "10.0.0.12", 30000),
        ("router", "front", "10.0.0.10", 8000),
        ("gateway", "front", "0.0.0.0", 8080),
    ]
    # Two TP4 prefill servers share the node's 8 GPUs: 0-3 and 4-7.
    assert (places["prefill-0"].base_gpu_id, places["prefill-1"].base_gpu_id) == (0, 4)
    assert places["decode-0"].base_gpu_id == 0 and places["decode-0"].gpus == 4
    assert (places["prefill-0"].bootstrap_port, places["prefill-1"].bootstrap_port) == (8998, 8999)
    assert places["gateway"].operator_port == 9100


def test_server_commands_bind_their_node_and_name_its_gpus_and_nics(tmp_path):
    topo = load(tmp_path)
    p = next(p for p in topo.placements() if p.name == "prefill-1")
    argv = topo.server_argv("/m", p.port, p.role, p.bootstrap_port, p)
    assert argv[argv.index("--host") + 1] == "10.0.0.11"
    assert argv[argv.index("--base-gpu-id") + 1] == "4"
    assert argv[argv.index("--disaggregation-ib-device") + 1] == "mlx5_0,mlx5_1"
    assert argv[argv.index("--disaggregation-bootstrap-port") + 1] == "8999"
    d = next(p for p in topo.placements() if p.name == "decode-0")
    assert "--disaggregation-ib-device" not in topo.server_argv("/m", d.port, d.role, None, d)  # its node has none


BAD_NODES = [
    (THREE_NODES.replace('node = "decode-a"', 'node = "decode-b"'), "no such node"),
    (THREE_NODES.replace('[decode]\nnode = "decode-a"\n', "[decode]\n"), r"\[decode\]: a multi-node file places"),
    (THREE_NODES.replace('bind = "0.0.0.0:8080"\n', ""), "bind"),
    (THREE_NODES.replace('assertion_key_file = "assertion.key"\n', ""), "same assertion key"),
    (THREE_NODES.replace('"--tp-size", "4"', '"--tp-size", "8"'), "need 16 GPUs .* has 8"),
    (THREE_NODES.replace('host = "10.0.0.12"', 'host = "0.0.0.0"'), "private address"),
    (THREE_NODES.replace('name = "front"', 'name = "Front_1"'), "not a name"),
    (THREE_NODES.replace('[decode]\nnode = "decode-a"', '[decode]\nnode = "prefill-a"\nport = 30001'), "both listen"),
    (THREE_NODES.replace("[prefill]\n", '[prefill]\nargs = ["--host", "0.0.0.0"]\n'), "through the topology"),
    (THREE_NODES.replace('bind = "0.0.0.0:8080"', 'bind = "8080"'), "host:port"),
]


@pytest.mark.parametrize("body, msg", BAD_NODES)
def test_a_multi_node_file_that_cannot_be_placed_fails_at_load(tmp_path, body, msg):
    with pytest.raises(ValueError, match=msg):
        load(tmp_path, body)


def test_a_single_host_file_cannot_set_ports_or_nodes(tmp_path):
    body = '[model]\npreset = "glm53-tiny"\ncontext_length = 512\n[worker]\nkv_tokens = 2048\n[router]\nport = 8000\n'
    with pytest.raises(ValueError, match="names no"):
        load(tmp_path, body)


def dry_run(tmp_path, *args):
    (tmp_path / "nodes.toml").write_text(THREE_NODES)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "glm53_serving.launch",
            "--config",
            str(tmp_path / "nodes.toml"),
            "--dry-run",
            "--run-dir",
            str(tmp_path / "run"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_dry_run_per_node_prints_only_that_nodes_processes_and_is_stable(tmp_path):
    front = dry_run(tmp_path, "--node", "front")
    assert "# router\n" in front and "# gateway\n" in front and "# prefill-0" not in front
    # The router reaches the workers on their nodes' private addresses; the gateway's client
    # listener is the public bind, its operator listener the node's private address.
    assert "--prefill http://10.0.0.11:30000 8998" in front and "--decode http://10.0.0.12:30000" in front
    assert "--host 0.0.0.0 --port 8080 --operator-host 10.0.0.10" in front
    assert "--operator-port 9100" in front
    assert dry_run(tmp_path, "--node", "front") == front  # fixed ports: the same commands every time
    prefill = dry_run(tmp_path, "--node", "prefill-a")
    assert prefill.count("sglang.launch_server") == 2 and "# router" not in prefill
    assert "GLM53_PREFILL_BOOTSTRAP=10.0.0.11:8998,10.0.0.11:8999" in prefill
    assert "SGLANG_HOST_IP=10.0.0.11" in prefill


def test_a_multi_node_file_needs_node_to_start(tmp_path):
    (tmp_path / "nodes.toml").write_text(THREE_NODES)
    out = subprocess.run(
        [sys.executable, "-m", "glm53_serving.launch", "--config", str(tmp_path / "nodes.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "start each with --node NAME" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "glm53_serving.launch", "--config", str(tmp_path / "nodes.toml"), "--node", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--node x" in out.stderr

"""Topology files parse, validate at load time, and derive each process's arguments."""

import socket
import subprocess
import sys

import pytest

from glm53_serving import cpu, topology
from glm53_serving.topology import REPO_LAUNCH_DIR, Topology

CONFIGS = sorted(REPO_LAUNCH_DIR.glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_topology_loads(path):
    topo = Topology.load(path)
    assert topo.topology in ("single", "pd")
    assert topo.tenants.mode != "off"
    if topo.topology == "pd":
        # No tenant's failures may make the router refuse the others (issue: no cross-tenant DoS),
        # and affinity needs the manual policy.
        argv = topo.router_argv(1, 2, [("http://p", 3)], ["http://d"])
        assert {"--disable-retries", "--disable-circuit-breaker"} <= set(argv)
        assert argv[argv.index("--policy") + 1] == "manual"
        # a dead worker leaves the rotation in seconds (checks every 2 s, out after 2 failures)
        assert argv[argv.index("--health-check-interval-secs") + 1] == "2"
        assert argv[argv.index("--health-failure-threshold") + 1] == "2"
        # decodes drop a dead prefill after 2 missed heartbeats 5 s apart; its restart waits for that
        assert topo.process_env()["SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"] == "5"
        assert topo.prefill_restart_delay_s() == 18.0
    assert topo.restart_limit == 3
    # servers outlast the router's and the gateway's pooled idle connections (50 s; 5 s)
    assert int(topo.process_env()["SGLANG_TIMEOUT_KEEP_ALIVE"]) > 50


def test_cpu_default_derives_cpu_only_settings():
    topo = Topology.load(REPO_LAUNCH_DIR / "cpu.toml")
    assert topo.topology == "pd" and topo.device == "cpu"
    env = topo.process_env()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["SGLANG_HOST_IP"] == "127.0.0.1"
    prefill = topo.server_argv("/m", 1, "prefill", bootstrap_port=2)
    decode = topo.server_argv("/m", 3, "decode")
    assert "--disaggregation-bootstrap-port" in prefill and "--device" in prefill
    i = decode.index(cpu.DECODE_ARGS[0])
    assert decode[i : i + len(cpu.DECODE_ARGS)] == list(cpu.DECODE_ARGS)
    assert "cpu_tensor" not in prefill


def test_gpu_topology_gets_no_cpu_settings(tmp_path):
    p = tmp_path / "gpu.toml"
    p.write_text(
        'topology = "pd"\ndevice = "cuda"\n[model]\npath = "/models/x"\ncontext_length = 4096\n[worker]\nkv_tokens = 8192\n'
    )
    topo = Topology.load(p)
    assert "SGLANG_USE_CPU_ENGINE" not in topo.process_env()
    argv = topo.server_argv("/m", 1, "decode")
    assert "cpu" not in argv and "cpu_tensor" not in argv and "torch_native" not in argv


M = '[model]\npreset = "glm53-tiny"\ncontext_length = 512\n[worker]\nkv_tokens = 2048\n'


BAD = [
    ('topology = "ring"\n' + M, "topology must be"),
    ('[model]\npreset = "glm53-tiny"\npath = "/x"\n', "exactly one of preset, path"),
    ('[model]\npreset = "llama"\n', "model.preset"),
    (M + "[decode]\ncount = 0\n", "at least one server"),
    ("nonsense = 1\n" + M, "nonsense"),
    ('[model]\npreset = "glm53-tiny"\ncontext_length = 512\n', "KV budget"),
    ('[model]\npreset = "glm53-tiny"\n[worker]\nkv_tokens = 9\n', "context_length"),
    (M.replace("[worker]\n", '[worker]\nargs = ["--max-total-tokens", "9"]\n'), "through the topology"),
    (M + "[gateway]\nmax_body_bytes = 100\n[router]\nmax_payload_bytes = 50\n", "grow inward"),
    (M.replace("[worker]\n", "[worker]\nmax_body_bytes = 10\n"), "grow inward"),
    (M + "[decode]\nmax_body_bytes = 10\n", "set it in \\[worker\\]"),
    (M + "[gateway]\nupstream_timeout_s = 100\n[router]\nrequest_timeout_s = 100\n", "gateway answers first"),
    (M + '[router]\nargs = ["--max-payload-size", "9"]\n', "max_payload_bytes"),
    (M + '[router]\nargs = ["--retry-max-retries", "3"]\n', "without retries"),
    (M + '[router]\nargs = ["--cb-failure-threshold", "50"]\n', "without a circuit breaker"),
    (M + '[router]\nargs = ["--health-check-interval-secs", "60"]\n', "the launcher sets the health checks"),
    ("restart_limit = -1\n" + M, "restart_limit must be 0 or more"),
    (
        'topology = "single"\n[model]\npreset = "glm53-tiny"\ncontext_length = 512\n[prefill]\nkv_tokens = 64\n',
        "KV budget",
    ),
]


@pytest.mark.parametrize("body, msg", BAD)
def test_bad_topologies_fail_at_load(tmp_path, body, msg):
    p = tmp_path / "bad.toml"
    p.write_text(body)
    with pytest.raises(ValueError, match=msg):
        Topology.load(p)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("as_", ["single", "pd"])
def test_every_combination_the_loader_accepts_has_the_limits_the_gateway_needs(path, as_):
    # `--topology single` on the PD file passed --dry-run, then the gateway exited for want of
    # deployment limits after the server had loaded its weights: the loader now refuses it.
    try:
        topo = Topology.load(path, topology=as_)
    except ValueError as e:
        # A PD file without a worker budget cannot run single; a single-node single file
        # (glm53-h200-single.toml) places no prefill or decode server, so it cannot run PD.
        assert (as_ == "single" and "single server needs its KV budget" in str(e)) or (
            as_ == "pd" and "[prefill]: a multi-node file places every process: set node" in str(e)
        )
        return
    _, limits = topo.admission_plan()
    assert limits is not None and "GLM53_DEPLOYMENT_LIMITS" in topo.process_env()


def test_single_without_a_worker_kv_budget_is_refused_at_load(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text(
        '[model]\npath = "/m"\ncontext_length = 512\n[prefill]\nkv_tokens = 2048\n[decode]\nkv_tokens = 2048\n'
    )
    assert Topology.load(p).topology == "pd"
    with pytest.raises(ValueError, match=r"single server needs its KV budget: set kv_tokens in \[worker\]"):
        Topology.load(p, topology="single")


def test_the_loader_refuses_bad_files_under_python_O(tmp_path):
    # The checks were `assert`s: under python -O every bad file above loaded.
    bodies = [b for b, _ in BAD]
    for i, body in enumerate(bodies):
        (tmp_path / f"{i}.toml").write_text(body)
    code = (
        "import sys, pathlib\nfrom glm53_serving.topology import Topology\n"
        "loaded = []\n"
        f"for p in sorted(pathlib.Path({str(tmp_path)!r}).glob('*.toml')):\n"
        "    try:\n        Topology.load(p)\n        loaded.append(p.name)\n"
        "    except ValueError:\n        pass\n"
        "print('loaded:', loaded, 'optimize:', sys.flags.optimize)\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "loaded: [] optimize: 1", out.stdout


def test_dry_run_prints_every_process_and_the_client_url():
    out = subprocess.run(
        [sys.executable, "-m", "glm53_serving.launch", "--dry-run"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "# prefill-0" in out.stdout and "# decode-0" in out.stdout and "# router" in out.stdout
    assert "sglang_router.launch_router --pd-disaggregation" in out.stdout
    single = subprocess.run(
        [sys.executable, "-m", "glm53_serving.launch", "--dry-run", "--topology", "single"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "# server" in single.stdout and "router" not in single.stdout


def test_help_documents_the_launcher():
    out = subprocess.run(
        [sys.executable, "-m", "glm53_serving.launch", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--topology" in out.stdout and "Ctrl-C" in out.stdout


def topo_with(tmp_path, body):
    p = tmp_path / "t.toml"
    p.write_text(body)
    return Topology.load(p)


def test_incident_configuration_refuses_with_both_numbers_and_both_ways_out(tmp_path):
    topo = topo_with(
        tmp_path,
        '[model]\npath = "/m"\ncontext_length = 1048576\n'
        "[prefill]\nkv_tokens = 681280\n[decode]\nkv_tokens = 2000000\n",
    )
    with pytest.raises(ValueError) as e:
        topo.admission_plan()
    msg = str(e.value)
    assert "1048576" in msg and "681280" in msg and "prefill" in msg
    assert "enlarge the pool" in msg and "clamp_context_to_kv = true" in msg


def test_clamp_switch_advertises_the_smallest_pool(tmp_path):
    topo = topo_with(
        tmp_path,
        '[model]\npath = "/m"\ncontext_length = 1048576\n[admission]\nclamp_context_to_kv = true\n'
        "[prefill]\nkv_tokens = 681280\n[decode]\nkv_tokens = 2000000\n",
    )
    ctx, limits = topo.admission_plan()
    assert ctx == 681280 and limits.context_length == 681280
    assert limits.max_input_tokens == 681280 - 1 - 5
    assert (
        "--context-length" in (argv := topo.server_argv("/m", 1, "decode"))
        and argv[argv.index("--context-length") + 1] == "681280"
    )


def test_deployment_limits_reach_every_server(tmp_path):
    import json

    from glm53_serving import env
    from glm53_serving.admission import Limits

    def limits(name):
        return Limits(**json.loads(Topology.load(REPO_LAUNCH_DIR / name).process_env()[env.DEPLOYMENT_LIMITS.name]))

    gqa = limits("cpu-gqa.toml")  # page size 1: docs/admission.md's worked example
    assert gqa.max_input_tokens == 506 and gqa.max_total_tokens == 510
    dsa = limits("cpu.toml")  # 64-token pages: two pages of slack under the 512 window
    assert dsa.max_input_tokens == 384 and dsa.max_total_tokens == 384
    assert gqa.max_output_tokens is None and dsa.max_output_tokens is None  # presets: the window's


@pytest.mark.parametrize("name", ["glm53-h200-single.toml", "glm53-h200-pd.toml"])
def test_a_glm53_checkpoint_serves_at_most_128k_output_tokens_unless_the_file_says(name, tmp_path):
    from glm53_serving import model

    topo = Topology.load(REPO_LAUNCH_DIR / name)
    assert topo.admission_plan()[1].max_output_tokens == model.MAX_OUTPUT_TOKENS == 131_072
    text = (REPO_LAUNCH_DIR / name).read_text().replace("[model]\n", "[model]\nmax_output_tokens = 32768\n", 1)
    (tmp_path / name).write_text(text)
    assert Topology.load(tmp_path / name).admission_plan()[1].max_output_tokens == 32_768
    (tmp_path / name).write_text(text.replace("32768", "0"))
    with pytest.raises(ValueError, match="max_output_tokens must be positive"):
        Topology.load(tmp_path / name)


def test_body_limits_and_timeouts_grow_inward_so_the_gateway_answers_first():
    topo = Topology.load(REPO_LAUNCH_DIR / "cpu.toml")
    gateway, router, worker = topo.body_limits()
    assert gateway == 8 * 1024 * 1024 and router == worker == 2 * gateway
    argv = topo.router_argv(1, 2, [("http://p", 3)], ["http://d"])
    assert argv[argv.index("--max-payload-size") + 1] == str(router)
    assert float(argv[argv.index("--request-timeout-secs") + 1]) > topo.gateway.upstream_timeout_s
    assert topo.process_env()["GLM53_MAX_BODY_BYTES"] == str(worker)
    gw = topo.gateway_argv("http://r", "/m", 4)
    assert gw[gw.index("--max-body-bytes") + 1] == str(gateway) and gw[gw.index("--max-n") + 1] == "1"
    single = Topology.load(REPO_LAUNCH_DIR / "cpu.toml", topology="single").gateway_argv("http://s", "/m", 4)
    assert single[single.index("--max-n") + 1] == "128"


def test_free_ports_are_outside_the_ephemeral_range_distinct_and_bindable():
    # An ephemeral port can be taken as an outgoing connection's local end between pick and bind.
    low, high = topology._ephemeral_ports()
    ports = [topology.free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(not low <= p <= high for p in ports), ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_only_a_dsa_preset_on_cpu_gets_the_dsa_rows():
    from glm53_serving import env

    assert env.CPU_DSA.name not in Topology.load(REPO_LAUNCH_DIR / "cpu-gqa.toml").process_env()
    assert Topology.load(REPO_LAUNCH_DIR / "cpu.toml", "single").process_env()[env.CPU_DSA.name] == "1"


def test_a_glm53_checkpoint_gets_sglangs_glm5_parsers_unless_the_topology_names_others():
    from glm53_serving.topology import GLM53_PARSERS

    prod = Topology.load(REPO_LAUNCH_DIR / "glm53-h200-pd.toml")
    for role in ("prefill", "decode"):
        argv = prod.server_argv("/models/GLM-5.3", 1, role, bootstrap_port=2)
        for flag, value in GLM53_PARSERS:
            assert argv[argv.index(flag) + 1] == value and argv.count(flag) == 1
        parsed = sglang_parser().parse_args(argv[3:])  # SGLang's own parser knows these names
        assert (parsed.tool_call_parser, parsed.reasoning_parser) == ("glm47", "glm45")
        assert parsed.stream_response_default_include_usage is True
    prod.decode.args = [*prod.decode.args, "--reasoning-parser", "deepseek-r1"]
    argv = prod.server_argv("/models/GLM-5.3", 1, "decode")
    assert argv.count("--reasoning-parser") == 1 and argv[argv.index("--reasoning-parser") + 1] == "deepseek-r1"
    # The embedded presets have no tool-call or thinking tokens: no parser
    tiny = Topology.load(REPO_LAUNCH_DIR / "cpu.toml").server_argv("/m", 1, "single")
    assert not {flag for flag, _ in GLM53_PARSERS} & set(tiny)


def sglang_parser():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser

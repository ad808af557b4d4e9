"""The whole-stack bench's gateway CPU per request and its share of the rest of the full stack's
path (servers with their children, router), from the same before/after readings as CPU/token;
fake processes and a fake load generator, no servers."""

import types

import pytest

import glm53_serving.bench.__main__ as bench_main
from glm53_serving.bench import report

# CPU seconds each fake process spends per request of a run, by side: pid -> seconds
ON = {1: 0.010, 2: 0.030, 3: 0.020, 4: 0.005, 5: 0.002}  # prefill, its scheduler, decode, router, gateway
OFF = {11: 0.011, 12: 0.029, 13: 0.021, 14: 0.004, 15: 0.003}  # the same; 15: the idle gateway, not counted
CHILDREN = {1: [2], 11: [12]}


class FakeProcess:
    cpu: dict[int, float] = {}  # pid -> CPU seconds so far

    def __init__(self, pid):
        self.pid = pid

    def children(self, recursive=False):
        return [FakeProcess(c) for c in CHILDREN.get(self.pid, [])]

    def cpu_times(self):
        user = self.cpu[self.pid]
        return (0.75 * user, 0.25 * user, 0.0, 0.0)  # user, system, children's (not counted)


def info(pids, client_url, router_url):
    names = ("prefill", "decode", "router", "gateway")
    processes = [{"name": n, "pid": p, "url": f"http://{n}-{p}"} for n, p in zip(names, pids)]
    processes[2]["url"] = router_url
    return {"client_url": client_url, "processes": processes}


def test_gateway_cpu_per_request_and_share_are_reported_per_round_and_median(tmp_path, monkeypatch, capsys):
    up = {
        ("pd", "on"): (None, info([1, 3, 4, 5], "http://gateway", "http://router-on")),
        ("pd", "off"): (None, info([11, 13, 14, 15], "http://gateway-off", "http://router-off")),
    }
    spend = {"http://gateway": ON, "http://router-off": OFF}
    scale = iter([1, 1, 1, 1, 2, 2, 4, 4])  # warm-ups, then rounds 0..2 (both sides): CPU per request x scale

    def fake_bench(jobs, load, concurrency, dataset):
        [(url, _, key, _)] = jobs
        assert key == "cred"
        k = next(scale)
        for pid, s in spend[url].items():
            FakeProcess.cpu[pid] += s * k * load.num_prompts
        # the off side's idle gateway gets some CPU too: not on its path, never counted
        FakeProcess.cpu[15] += 1.0
        return [{**{m: 1.0 for m in report.METRICS}, "completed": load.num_prompts, "total_output_tokens": 100}]

    monkeypatch.setattr(FakeProcess, "cpu", {pid: 0.0 for pid in (*ON, *OFF)})
    monkeypatch.setattr(bench_main, "psutil", types.SimpleNamespace(Process=FakeProcess))
    monkeypatch.setattr(bench_main, "bench", fake_bench)
    monkeypatch.setattr(bench_main, "credential", lambda info, who: "cred")
    a = types.SimpleNamespace(
        concurrency=[2], rounds=3, num_prompts=8, input_len=64, output_len=8, range_ratio=0.25, prefix_groups=16
    )
    [p] = bench_main.run_topology(tmp_path, a, "pd", up)

    g = p["gateway"]
    servers = ON[1] + ON[2] + ON[3] + ON[4]  # prefill with its scheduler, decode, router
    for r, k in zip(g["rounds"], (1, 2, 4)):
        assert r["completed"] == 8
        assert r["gateway_cpu_s"] == pytest.approx(ON[5] * k * 8)
        assert r["servers_cpu_s"] == pytest.approx(servers * k * 8)
        assert r["gateway_cpu_us_per_request"] == pytest.approx(1e6 * ON[5] * k)
        assert r["servers_cpu_us_per_request"] == pytest.approx(1e6 * servers * k)
        assert r["gateway_cpu_share"] == pytest.approx(ON[5] / servers)
    assert g["median"]["gateway_cpu_us_per_request"] == pytest.approx(1e6 * ON[5] * 2)
    assert g["median"]["servers_cpu_us_per_request"] == pytest.approx(1e6 * servers * 2)
    assert g["median"]["gateway_cpu_share"] == pytest.approx(ON[5] / servers)  # 3.08 %
    assert g["target_share"] == 0.05

    # CPU/token as before: the whole path, gateway included on the full stack, not the idle one upstream
    on_tokens = [r["cpu_us_per_token"] for r in p["rounds"]["on"]]
    off_tokens = [r["cpu_us_per_token"] for r in p["rounds"]["off"]]
    assert on_tokens == pytest.approx([1e6 * sum(ON.values()) * k * 8 / 100 for k in (1, 2, 4)])
    assert off_tokens == pytest.approx([1e6 * (sum(OFF.values()) - OFF[15]) * k * 8 / 100 for k in (1, 2, 4)])

    out = capsys.readouterr().out
    assert "gateway CPU:     4,000 µs/request, 3.08% of the servers' and router's 130,000 µs/request" in out, out
    assert "rounds: 2,000, 4,000, 8,000 µs, 3.08%, 3.08%, 3.08%" in out, out

    meta = {"command": "python -m glm53_serving.bench", "date": "d", "machine": {"cpus": 2}, "model": "m"}
    table = report.markdown({**meta, "load": {"rounds": 3}}, [p])
    assert (
        "| topology | conc. | gateway CPU/request (µs) | servers + router CPU/request (µs) | gateway share (%) | ≤ 5% |"
        in table
    ), table
    assert (
        "| pd | 2 | 4,000 (2,000, 4,000, 8,000) | 130,000 (65,000, 130,000, 260,000) | 3.08% (3.08%, 3.08%, 3.08%) | yes |"
        in table
    ), table


def test_a_gateway_over_its_target_is_marked_and_nothing_divides_by_zero():
    over = report.gateway_cpu(0.6, 10.0, 100)
    assert over["gateway_cpu_us_per_request"] == pytest.approx(6000) and over["gateway_cpu_share"] == pytest.approx(
        0.06
    )
    empty = report.gateway_cpu(0.0, 0.0, 0)
    assert empty["gateway_cpu_us_per_request"] is None and empty["gateway_cpu_share"] is None
    p = {"topology": "single", "concurrency": 1, "gateway": report.gateway_point([{**over, "completed": 100}])}
    assert "| single | 1 | 6,000 (6,000) | 100,000 (100,000) | 6.00% (6.00%) | **no** |" in report.gateway_table([p])
    # CPU seconds come in 10 ms ticks: 3 of the gateway's over 60 of the rest's is 5.00 %, within the
    # target, although their difference of two readings each divides to 0.0500000000000003
    at = report.gateway_cpu(0.03000000000000025, 0.6000000000000014, 16)
    assert at["gateway_cpu_share"] > 0.05
    p = {"topology": "single", "concurrency": 4, "gateway": report.gateway_point([{**at, "completed": 16}])}
    assert "| single | 4 | 1,875 (1,875) | 37,500 (37,500) | 5.00% (5.00%) | yes |" in report.gateway_table([p])

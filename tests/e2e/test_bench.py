"""`python -m glm53_serving.bench --quick` runs the whole stack and upstream, both topologies, and
writes its three files. It checks that the benchmark ran and wrote them, not its numbers (on 2
shared cores those swing by more than what they measure)."""

import json
import sys
import time

import psutil
import pytest

from glm53_serving.bench.report import GATEWAY, METRICS
from tests.e2e.launcher import run_whole

pytestmark = pytest.mark.e2e

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_bench_runs_both_topologies_and_sides_and_writes_its_files(tmp_path):
    out = tmp_path / "results"
    t0 = time.monotonic()
    run = run_whole([sys.executable, "-m", "glm53_serving.bench", "--quick", "--out", str(out)], timeout=540)
    took = time.monotonic() - t0
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    print(f"bench --quick took {took:.0f} s")

    results = json.loads((out / "results.json").read_text())
    points = results["points"]
    assert {p["topology"] for p in points} == {"single", "pd"}
    for p in points:
        assert p["concurrency"] in (1, 4)
        for side in ("on", "off"):
            assert set(METRICS) <= set(p["median"][side]), p["median"][side]
            m = p["median"][side]
            # PD's first chunk can carry two tokens (prefill's and decode's first), so with short
            # outputs half the gaps can be 0 ms: ITL only >= 0; everything else positive.
            assert all(v > 0 for k, v in m.items() if "itl" not in k), (p["topology"], side, m)
            assert all(v >= 0 for v in m.values()), (p["topology"], side, m)
            assert p["rounds"][side] and all(r["completed"] == p["prompts"] for r in p["rounds"][side])
        assert set(METRICS) <= set(p["ratio_median"]), p["ratio_median"]
        # the full stack's gateway CPU per request and its share of the servers' and router's
        gateway = p["gateway"]
        # CI checks that it ran, not its numbers: a quick run's gateway may spend under one 10 ms clock tick
        assert all(gateway["median"][k] >= 0 for k in GATEWAY), gateway
        assert [r["completed"] for r in gateway["rounds"]] == [p["prompts"]] * len(p["rounds"]["on"]), gateway
    assert results["meta"]["command"].startswith("python -m glm53_serving.bench --quick")

    table = (out / "results.md").read_text()
    for topology in ("single", "pd"):
        for side in ("full stack", "upstream", "on/off"):
            assert f"| {topology} | 1 | {side} |" in table and f"| {topology} | 4 | {side} |" in table, table
    assert "| topology | conc. | gateway CPU/request (µs) |" in table, table

    png = (out / "plot.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000, len(png)

    # Every deployment it started is gone: their launchers named the bench's log folder.
    logs = results["meta"]["logs"]
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if any(logs in arg for arg in p.info["cmdline"] or ())]
    assert not left, left

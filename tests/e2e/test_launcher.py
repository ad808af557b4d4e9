"""The launcher: clean stop on Ctrl-C, honest failure when a child dies, refusal when a hook is missing."""

import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.deployment import config_text
from tests.e2e.launcher import SlowStream, alive, launch, launcher_output, start

pytestmark = pytest.mark.e2e

SABOTAGE = str(Path(__file__).resolve().parents[1] / "support" / "sabotage")


def wait_exit(proc, timeout=300):
    t0 = time.monotonic()
    rc = proc.wait(timeout=timeout)
    return rc, time.monotonic() - t0


def test_ctrl_c_drains_the_gateway_then_leaves_no_child_alive_and_no_log_reports_a_crash(tmp_path):
    run = launch(tmp_path, "--topology", "pd")
    pids = run.info["all_pids"]
    # Ready means a real generation went through router, prefill and decode.
    r = httpx.get(f"{run.url}/ready", timeout=60)
    assert r.status_code == 200 and r.json() == {"ready": True}
    sent = time.monotonic()
    stream = SlowStream(run.url, run.client_headers()).started()
    run.proc.send_signal(signal.SIGINT)
    stop_after_s = time.monotonic() - sent
    refused_at, t0 = None, time.monotonic()
    while refused_at is None and time.monotonic() - t0 < 10:  # nothing new is admitted while it drains
        try:
            httpx.post(f"{run.url}/generate", json={"input_ids": [5]}, headers=run.client_headers(), timeout=5)
        except httpx.TransportError:
            refused_at = time.monotonic() - t0
        time.sleep(0.1)
    assert refused_at is not None and not stream.done, refused_at
    assert run.proc.wait(120) == 0
    stream.assert_whole()  # the running answer finished whole
    assert "draining gateway" in launcher_output(tmp_path)
    # The drained answer has its audit record, written before the gateway exited.
    rows = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    (mine,) = [r for r in rows if r["request_id"] == stream.rid]
    assert mine["tenant"] == "demo" and mine["status"] == 200 and mine["code"] is None
    # the gateway was still sending it when the stop began: it drained a live answer
    assert mine["latency_ms"] / 1000 > stop_after_s, (mine, stop_after_s)
    assert mine["completion_tokens"] == stream.max_new
    assert len(pids) >= 8
    assert alive(pids) == []
    assert "all children stopped" in launcher_output(tmp_path)
    logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
    assert {"prefill-0.log", "decode-0.log", "router.log", "gateway.log"} <= set(logs)
    # A normal stop is not a crash (the whole group got SIGTERM: "scheduler_0 crashed with exit code
    # -15" in every server log), and the router's log is plain text (it colours its console).
    assert [n for n, text in logs.items() if "crashed" in text or "Traceback" in text] == []
    assert "\x1b[" not in logs["router.log"] and "Starting router" in logs["router.log"]


def test_child_dying_at_startup_fails_with_its_log_tail(tmp_path):
    cfg = tmp_path / "broken.toml"
    cfg.write_text(config_text().replace('"--skip-server-warmup",', '"--skip-server-warmup", "--no-such-flag",'))
    rc, took = wait_exit(start(tmp_path, "--config", str(cfg)))
    out = launcher_output(tmp_path)
    assert rc == 1, out
    assert "exited with code" in out and "--no-such-flag" in out  # the child's own argparse error
    assert not (tmp_path / "ready.json").exists()


@pytest.mark.parametrize(
    "target",
    [
        "sglang.srt.managers.scheduler.Scheduler.get_init_info",  # the HTTP process refuses
        "sglang.srt.entrypoints.engine._wait_for_scheduler_ready",  # the scheduler refuses
        "sglang.srt.entrypoints.http_server._setup_and_run_http_server",  # the validator's warm-up: the HTTP process refuses
        "sglang.srt.entrypoints.http_server.launch_server",  # the front door: the HTTP process refuses
        "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.alloc",  # zeroing: the scheduler refuses
    ],
)
def test_missing_hook_stops_the_server_from_starting(tmp_path, target):
    proc = start(tmp_path, "--topology", "single", env={"PYTHONPATH": SABOTAGE, "GLM53_TEST_BREAK_HOOK": target})
    rc, _ = wait_exit(proc)
    out = launcher_output(tmp_path)
    assert rc == 1, out
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "glm53_serving: refusing to start" in log and target in log
    assert not (tmp_path / "ready.json").exists()


def test_disabled_guards_are_announced(tmp_path):
    run = launch(tmp_path, "--topology", "single", env={"GLM53_SERVING_DISABLE": "1"})
    try:
        status = httpx.get(
            f"{run.worker('server')}/server_info", timeout=30, headers=run.worker_headers("admin")
        ).json()["glm53_serving"]
        assert status == {**status, "active": False, "disabled_by": "GLM53_SERVING_DISABLE=1"}
        assert "guards are DISABLED" in (tmp_path / "server.log").read_text(errors="replace")
        assert "guards DISABLED" in launcher_output(tmp_path)
    finally:
        run.stop()


def test_a_child_that_dies_after_ready_is_restarted_up_to_the_limit_then_everything_stops(tmp_path):
    """restart_limit 1: the server, SIGKILLed after ready, comes back on its port with a new pid
    (restarts.jsonl, ready.json) and serves again; the second death stops the deployment with
    the reason, and no child is left."""
    import os

    cfg = tmp_path / "restart-once.toml"
    cfg.write_text("restart_limit = 1\n" + config_text())
    run = launch(tmp_path, "--config", str(cfg), "--topology", "single")
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    before = httpx.post(f"{run.url}/generate", json=body, headers=run.client_headers(), timeout=60).json()
    old = next(p["pid"] for p in run.info["processes"] if p["name"] == "server")
    os.killpg(old, signal.SIGKILL)
    deadline = time.monotonic() + 240
    while not (tmp_path / "restarts.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    (event,) = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert event["name"] == "server" and event["old_pid"] == old and event["exit_code"] == -9, event
    info = json.loads((tmp_path / "ready.json").read_text())
    new = next(p["pid"] for p in info["processes"] if p["name"] == "server")
    assert new == event["new_pid"] != old and info["restarts"] == {"server": 1}
    after = httpx.post(f"{run.url}/generate", json=body, headers=run.client_headers(), timeout=60)
    assert after.status_code == 200 and after.json()["output_ids"] == before["output_ids"], after.text
    os.killpg(new, signal.SIGKILL)
    rc, _ = wait_exit(run.proc, timeout=120)
    out = launcher_output(tmp_path)
    assert rc == 1 and "server exited with code -9" in out and "after 1 restart(s) (restart_limit 1)" in out, out
    assert alive(info["all_pids"]) == []


def test_prefill_and_decode_dying_together_are_both_restarted_and_serve_again(tmp_path):
    """PD, both servers SIGKILLed at once: the launcher restarts each (the decode at once, the
    prefill after its delay) and the deployment answers again, the same tokens as before. One
    restart at a time would have seen the other dead while waiting and stopped everything."""
    import os

    run = launch(tmp_path, "--topology", "pd")
    try:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
        before = httpx.post(f"{run.url}/generate", json=body, headers=run.client_headers(), timeout=60).json()
        old = {p["name"]: p["pid"] for p in run.info["processes"] if p["name"] in ("prefill-0", "decode-0")}
        for pid in old.values():
            os.killpg(pid, signal.SIGKILL)
        events, deadline = [], time.monotonic() + 300
        while len(events) < 2 and time.monotonic() < deadline and run.proc.poll() is None:
            time.sleep(0.5)
            path = tmp_path / "restarts.jsonl"
            events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        assert run.proc.poll() is None, launcher_output(tmp_path)
        assert {e["name"]: e["old_pid"] for e in events} == old, (events, launcher_output(tmp_path))
        # The decode was started at once, not queued behind the prefill's restart delay (both count
        # as back only when the router has both again).
        out = launcher_output(tmp_path)
        out = out[out.index("exited with code -9") :]
        assert out.index("started decode-0") < out.index("started prefill-0"), out
        info = json.loads((tmp_path / "ready.json").read_text())
        assert info["restarts"] == {"prefill-0": 1, "decode-0": 1}
        after = httpx.post(f"{run.url}/generate", json=body, headers=run.client_headers(), timeout=60)
        assert after.status_code == 200 and after.json()["output_ids"] == before["output_ids"], after.text
    finally:
        assert run.stop(timeout=120) == 0

"""The launcher's supervision after ready (Supervisor.keep_alive), on real child processes.

Each tick does what it can without waiting: a second death is noticed and restarted while a
first child is still coming back, and a prefill's restart delay holds up nobody else. Children
are real processes (a sleeping Python); probes are functions, so a test says when one is ready.
"""

import json
import signal
import sys
import time

import pytest

from glm53_serving.launch import Child, LaunchError, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture
def sup(tmp_path):
    s = Supervisor(tmp_path)
    yield s
    s.stop(grace_s=2)


def deploy(sup, tmp_path, names, ready=None):
    """Start `names` as children, all ready; `ready[name]` (a set of names) says whose probe passes."""
    ready = ready if ready is not None else set(names)
    for name in names:
        c = sup.start(Child(name, SLEEPER, {}, "http://127.0.0.1:9", tmp_path / f"{name}.log"))
        c.ready = True
    sup.probes = {name: (lambda c, client, name=name: name in ready) for name in names}
    return {c.name: c for c in sup.children}, ready


def kill(child):
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(5)


def restarts(tmp_path):
    path = tmp_path / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_second_death_is_restarted_while_the_first_child_is_still_coming_back(sup, tmp_path):
    kids, ready = deploy(sup, tmp_path, ["prefill-0", "gateway"])
    ready.discard("prefill-0")  # the first one does not come back for a while
    old = kids["prefill-0"].proc.pid
    kill(kids["prefill-0"])
    sup.keep_alive(3, 60)
    assert kids["prefill-0"].proc.pid != old and not kids["prefill-0"].ready
    old_gateway = kids["gateway"].proc.pid
    kill(kids["gateway"])
    sup.keep_alive(3, 60)  # one tick: the gateway is back while prefill-0 still is not
    assert kids["gateway"].proc.pid != old_gateway and kids["gateway"].proc.poll() is None
    assert [e["name"] for e in restarts(tmp_path)] == ["gateway"]
    ready.add("prefill-0")
    sup.keep_alive(3, 60)
    assert [e["name"] for e in restarts(tmp_path)] == ["gateway", "prefill-0"]
    assert sup.restarting == {} and sup.restarts == {"prefill-0": 1, "gateway": 1}
    assert restarts(tmp_path)[1]["old_pid"] == old


def test_a_prefill_waiting_out_its_restart_delay_holds_up_no_other_restart(sup, tmp_path):
    kids, _ = deploy(sup, tmp_path, ["prefill-0", "router"])
    sup.prefill_delay_s = 30
    old = kids["prefill-0"].proc.pid
    kill(kids["prefill-0"])
    t0 = time.monotonic()
    sup.keep_alive(3, 120)
    # Not started yet (the decodes must drop it first), and its reaped pid, which may be anyone's
    # by now, is no longer ours to list or signal.
    assert kids["prefill-0"].proc is None and old not in sup.pids()
    kill(kids["router"])
    sup.keep_alive(3, 120)
    assert time.monotonic() - t0 < 5  # neither tick slept the 30 s
    assert [e["name"] for e in restarts(tmp_path)] == ["router"]
    sup.restarting["prefill-0"].start_at = time.monotonic()  # its delay is over
    sup.keep_alive(3, 120)
    assert kids["prefill-0"].proc.poll() is None
    assert [e["name"] for e in restarts(tmp_path)] == ["router", "prefill-0"]


def test_a_restarted_server_counts_as_back_only_when_the_router_takes_it_again(sup, tmp_path):
    kids, ready = deploy(sup, tmp_path, ["router", "decode-0"])
    sup.headers = dict
    ready.discard("router")  # the router does not list it healthy yet
    kids["decode-0"].url = "http://127.0.0.1:9"  # abort_stranded's posts fail fast: nothing listens
    kill(kids["decode-0"])
    sup.keep_alive(3, 60)
    assert kids["decode-0"].ready and restarts(tmp_path) == []
    ready.add("router")
    sup.keep_alive(3, 60)
    assert [e["name"] for e in restarts(tmp_path)] == ["decode-0"]


def test_a_child_that_keeps_dying_while_restarting_stops_the_deployment_at_the_limit(sup, tmp_path):
    kids, ready = deploy(sup, tmp_path, ["gateway"])
    ready.clear()
    for _ in range(2):  # first death, then again while restarting: two restarts
        kill(kids["gateway"])
        sup.keep_alive(2, 60)
    assert sup.restarts == {"gateway": 2}
    kill(kids["gateway"])
    with pytest.raises(LaunchError, match=r"gateway exited with code -9 .*after 2 restart\(s\) \(restart_limit 2\)"):
        sup.keep_alive(2, 60)


def test_a_restart_that_is_not_ready_within_the_timeout_of_its_death_stops_the_deployment(sup, tmp_path):
    kids, ready = deploy(sup, tmp_path, ["gateway"])
    ready.clear()
    kill(kids["gateway"])
    sup.keep_alive(3, 60)
    sup.restarting["gateway"].t0 -= 61  # it died 61 s ago
    with pytest.raises(LaunchError, match="gateway not ready 60 s after it died"):
        sup.keep_alive(3, 60)


def test_the_gateway_starts_beside_the_servers_and_the_router_after_them(tmp_path, monkeypatch):
    """launch() on the default PD topology, each child a sleeping process and each probe a
    function: the gateway is started before any server is ready (its start-up overlaps theirs),
    the router only once both are; the gateway is still waited for last, and stop() still finds
    the front door first."""
    from glm53_serving import launch as launcher
    from glm53_serving.topology import Topology, default_config_path

    events = []
    real_start = Supervisor.start

    def start(self, child):
        events.append(("start", child.name))
        child.argv = SLEEPER
        return real_start(self, child)

    def wait_ready(sup, pending, *args, **kwargs):
        for name in pending:
            events.append(("ready", name))
            next(c for c in sup.children if c.name == name).ready = True

    monkeypatch.setattr(Supervisor, "start", start)
    monkeypatch.setattr(launcher, "wait_ready", wait_ready)
    monkeypatch.setattr(launcher, "resolve_model_path", lambda topo: "/models/none")
    monkeypatch.setattr(launcher, "smoke_generate", lambda url, headers: [1])
    sup = Supervisor(tmp_path)
    try:
        launcher.launch(Topology.load(default_config_path(), "pd"), tmp_path, sup)
        assert events == [
            ("start", "prefill-0"),
            ("start", "decode-0"),
            ("start", "gateway"),
            ("ready", "prefill-0"),
            ("ready", "decode-0"),
            ("start", "router"),
            ("ready", "router"),
            ("ready", "gateway"),
        ], events
        assert [c.name for c in sup.children] == ["prefill-0", "decode-0", "router", "gateway"]
    finally:
        sup.stop(grace_s=2)

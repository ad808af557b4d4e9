"""The isolation suite's own parts: its workloads keep each tenant's marker to that tenant, its
status oracle predicts exactly what admission.check decides, and each oracle fires on what it
names and on nothing else (glm53_serving/suite; its runs against real servers: tests/e2e/test_suite.py)."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm53_serving.admission import Limits, check
from glm53_serving.errors import ClientError
from glm53_serving.launch import Tenancy
from glm53_serving.suite import __main__ as suite_main
from glm53_serving.suite import oracles
from glm53_serving.suite.__main__ import flush, write_config
from glm53_serving.suite.client import Target
from glm53_serving.suite.oracles import Outcome
from glm53_serving.suite.workload import FIRST_TURN, MARKER_LEN, Call, Served, from_json, marker, to_json, workloads
from glm53_serving.topology import Topology

TENANTS = ["suite-a", "suite-b", "suite-c"]
SHAPE = Served(max_prompt=383, max_model_len=384, max_output=None, page=64)


def holds(ids, seq) -> bool:
    return any(tuple(ids[k : k + len(seq)]) == seq for k in range(len(ids) - len(seq) + 1))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(SHAPE, TENANTS, 4, 12, 16))
def test_a_workload_marks_each_prompt_with_its_tenant_only_and_spans_the_limit(calls):
    for c in calls:
        assert holds(c.prompt, marker(TENANTS, c.tenant))
        assert not any(holds(c.prompt, marker(TENANTS, t)) for t in TENANTS if t != c.tenant)
        assert MARKER_LEN < len(c.prompt) <= SHAPE.max_prompt + 40
        assert c.disconnect is None or c.stream
    assert from_json(to_json(calls, TENANTS)) == (calls, TENANTS)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(SHAPE, TENANTS, 4, 12, 16, sessions=True))
def test_a_session_continuation_opens_with_a_served_turn_and_its_whole_spans_the_limit(calls):
    for c in calls:
        if not c.then:
            continue
        first = c.first_turn()
        assert oracles.predicted(first, SHAPE) == (200, None) and not first.stream
        assert not any(holds(c.then, marker(TENANTS, t)) for t in TENANTS if t != c.tenant)
        whole = c.continued([7] * FIRST_TURN)
        assert whole.prompt == (*c.prompt, *[7] * FIRST_TURN, *c.then)
        assert (whole.max_new, whole.stream, whole.disconnect, whole.abort) == (
            c.max_new,
            c.stream,
            c.disconnect,
            c.abort,
        )
        assert len(c.prompt) + FIRST_TURN < len(whole.prompt) <= SHAPE.max_prompt + 40
    assert from_json(to_json(calls, TENANTS)) == (calls, TENANTS)


def test_session_continuations_are_drawn_only_where_asked_and_reach_over_the_limit():
    from hypothesis import find
    from hypothesis.errors import NoSuchExample

    assert find(
        workloads(SHAPE, TENANTS, 8, 12, 16, sessions=True),
        lambda calls: any(c.then and len(c.continued([0] * FIRST_TURN).prompt) > SHAPE.max_prompt for c in calls),
        settings=settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck)),
    )
    with pytest.raises(NoSuchExample):
        find(
            workloads(SHAPE, TENANTS, 8, 12, 16),
            lambda calls: any(c.then for c in calls),
            settings=settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck)),
        )


@settings(max_examples=500, deadline=None)
@given(
    prompt=st.integers(1, 450),
    max_new=st.one_of(st.none(), st.integers(1, 500)),
    cap=st.one_of(st.none(), st.integers(1, 400)),
)
def test_the_status_oracle_predicts_what_admission_decides(prompt, max_new, cap):
    shape = Served(383, 384, cap, 64)
    try:
        check(Limits(384, 384, 512, max_output_tokens=cap), prompt, max_new)
        decided = (200, None)
    except ClientError as e:
        decided = (400, e.code)
    assert oracles.predicted(Call("suite-a", (5,) * prompt, max_new, False), shape) == decided


def out(ids=None, status=200, code=None, body="", left=False, seconds=1.0, finish=None):
    return Outcome(status, code, ids, body, seconds, left, finish)


def test_an_aborted_call_may_end_early_with_its_own_tokens_only():
    c = Call("suite-a", (5, 6, 7, 8), 4, True, abort=True)
    solo = {c.solo_key: [1, 2, 3, 4]}
    assert oracles.differential([c], [out([1, 2], finish="abort")], solo, SHAPE) == []  # aborted after 2
    assert oracles.differential([c], [out([1, 2, 3, 4], finish="length")], solo, SHAPE) == []  # the abort lost the race
    (f,) = oracles.differential([c], [out([1, 7], finish="abort")], solo, SHAPE)
    assert "tokens so far are not its own" in f.detail
    # a "length" finish short of what it asked is what an abort must never turn into (sglang PR 33508)
    (f,) = oracles.differential([c], [out([1, 2], finish="length")], solo, SHAPE)
    assert "2 tokens, not 4" in f.detail
    with pytest.raises(ValueError):
        Call("suite-a", (5,), 4, False, abort=True)  # an aborted call is streamed


def test_the_differential_oracle_fires_on_other_tokens_or_another_length_only():
    c = Call("suite-a", (5, 6, 7, 8), 3, False)
    solo = {c.solo_key: [1, 2, 3]}
    assert oracles.differential([c], [out([1, 2, 3])], solo, SHAPE) == []
    assert oracles.differential([c], [out(left=True)], solo, SHAPE) == []  # the client left
    (f,) = oracles.differential([c], [out([1, 9, 3])], solo, SHAPE)
    assert f.oracle == "differential" and "at token 1" in f.detail
    (f,) = oracles.differential([c], [out([1, 2])], solo, SHAPE)
    assert "2 tokens, not 3" in f.detail
    unset = Call("suite-a", (5,) * 380, None, False)  # no max_tokens: the rest of the budget
    assert oracles.differential([unset], [out([1] * 4)], {}, SHAPE) == []


def test_the_canary_fires_on_another_tenants_marker_or_name_not_on_its_own():
    c = Call("suite-a", (5, 6, 7, 8), 8, False)
    mine, theirs = list(marker(TENANTS, "suite-a")), list(marker(TENANTS, "suite-b"))
    assert oracles.canary([c], [out([1, *mine, 2], body="suite-a")], TENANTS) == []
    (f,) = oracles.canary([c], [out([1, *theirs, 2])], TENANTS)
    assert "suite-b's marker" in f.detail
    (f,) = oracles.canary([c], [out([1], body='{"error": "not yours: suite-c"}')], TENANTS)
    assert "names tenant suite-c" in f.detail


def test_the_status_oracle_fires_on_a_wrong_status_or_code_or_a_wait_past_the_bound():
    over = Call("suite-a", (5,) * 384, 1, False)
    ok = Call("suite-a", (5,) * 10, 4, True)
    assert oracles.status([over, ok], [out(status=400, code="context_length_exceeded"), out([1] * 4)], SHAPE, 60) == []
    (f,) = oracles.status([over], [out([1])], SHAPE, 60)  # the incident's signature: a 200
    assert "the formula says 400 context_length_exceeded" in f.detail
    (f,) = oracles.status([ok], [out([1] * 4, seconds=61)], SHAPE, 60)
    assert "bound" in f.detail
    (f,) = oracles.status([ok], [out(code="kv_isolation_violation")], SHAPE, 60)  # a 200 that ends in an error
    assert "got 200 kv_isolation_violation" in f.detail


def state(pages=32, free=32, evictable=0, owned=0, running=0, queued=0, deferred=0, idle=True):
    return {
        "idle": idle,
        "deferred_releases": deferred,
        "pages": pages,
        "free_pages": free,
        "evictable_pages": evictable,
        "owned_pages": owned,
        "running_requests": running,
        "queued_requests": queued,
        "page_size": 64,
    }


@pytest.mark.parametrize(
    "before, after, fires",
    [
        (state(free=30, evictable=2, owned=2), state(), False),  # two cached pages, then flushed
        (state(free=30, evictable=2, owned=None), state(owned=None), False),  # owner part off: tags unknown
        (state(running=1), state(), True),  # a request still held
        (state(idle=False), state(), True),  # no request listed, but SGLang's scheduler is not idle
        (state(free=30, owned=2, deferred=1), state(), True),  # a failed transfer's pages, not yet released
        (state(free=29, evictable=2, owned=3), state(), True),  # a page in use that no cache holds
        (state(free=30, evictable=2, owned=3), state(), True),  # a tag on a free page
        (state(), state(free=31), True),  # a page not back after the flush
        (state(), state(owned=1), True),  # a tag left after the flush
    ],
)
def test_the_drain_oracle(before, after, fires):
    assert bool(oracles.drain({"w": before}, {"w": after})) == fires


def test_a_worker_that_refuses_the_deferred_cache_flush_is_a_drain_finding():
    """The drain oracle's flush waits for SGLang's idle state (`?timeout=`); a worker that answers
    400 held something past the bound, and that is said, not read as pages leaked."""
    asked = []

    class Worker(BaseHTTPRequestHandler):
        def do_POST(self):
            asked.append((self.server.server_port, self.path))
            busy = self.server.server_port == busy_port
            body = b"Timed out waiting for idle state." if busy else b"Cache flushed.\n"
            self.send_response(400 if busy else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Worker) for _ in range(2)]
    busy_port = servers[1].server_port
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        workers = {"decode-0": servers[0], "prefill-0": servers[1]}
        target = Target("pd", "", {}, {n: f"http://127.0.0.1:{s.server_port}" for n, s in workers.items()}, None)
        (f,) = flush(target, 7.0)
    finally:
        for s in servers:
            s.shutdown()
    assert f.oracle == "drain" and f.detail.startswith("prefill-0 refused a cache flush for 7 s: Timed out")
    assert sorted(p for _, p in asked) == ["/flush_cache?timeout=7.0"] * 2


def test_the_suite_config_names_its_tenants_file_so_the_launcher_finds_it_from_a_relative_out(tmp_path, monkeypatch):
    """The default --out is relative (suite-out), and a topology file's paths are read relative
    to the file's own directory: the launcher must find the suite's tenants file, not the out
    dir's path twice over."""
    monkeypatch.chdir(tmp_path)
    cfg, keys = write_config(Path("suite-out") / "run-pd")
    topo = Topology.load(cfg, "pd")
    tenancy = Tenancy.prepare(topo, tmp_path / "launch", create=False)
    assert tenancy.tenants_file == tmp_path / "suite-out" / "run-pd" / "suite-tenants.toml"
    assert tenancy.tenants_file.is_file() and sorted(keys) == sorted(suite_main.TENANTS)

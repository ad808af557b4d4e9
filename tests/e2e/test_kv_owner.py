"""KV owner check and PD handoff length check on real servers, under injected faults.

The faults come from tests/support/kv_fault (a test-only sitecustomize, active only with its env
vars): a request whose rid carries a marker gets another tenant's live slot written into its KV
row, or, in PD, a handoff length one token short or long. Victim and owner are two real tenants
(demo and demo-b: their namespaces are the gateway's, never the client's), and every test reads
the harness's log to prove the foreign slot was really reached. That request must fail alone
with the contract's 500 body; everything else keeps its exact greedy output and the server stays
healthy."""

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from glm53_serving.topology import DSA_PRESETS
from tests.e2e.deployment import LONG, PAGE, TOPOLOGY, T
from tests.e2e.launcher import eventually, launch, worker_events

pytestmark = pytest.mark.e2e

KV_FAULT = str(Path(__file__).resolve().parents[1] / "support" / "kv_fault")
# A prompt whose pages outlive its request in the prefix cache (the "live page another tenant
# owns" of the scenarios below): the radix cache keeps whole pages only, so with 64-token pages
# the prompt spans two of them.
PROMPT = [(i * 7) % 300 + 5 for i in range(40 if PAGE == 1 else 2 * PAGE + 8)]
# The other tenant's long generations: as long as its budget allows after PROMPT.
OTHERS_NEW = min(LONG, T - len(PROMPT) - 8)


def _env(tmp_path):
    return {
        "PYTHONPATH": KV_FAULT,
        "GLM53_TEST_KV_FOREIGN": "kvfault-foreign",
        "GLM53_TEST_KV_SHORT_HANDOFF": "kvfault-short",
        "GLM53_TEST_KV_LONG_HANDOFF": "kvfault-long",
        "GLM53_TEST_KV_REBOOTSTRAP_SHORT": "kvfault-rebootstrap",
        "GLM53_TEST_KV_FOREIGN_DECODE": "kvfault-decode",
        "GLM53_TEST_KV_POISON_TAIL": "kvfault-poison",
        "GLM53_TEST_KV_SHARE_PAGE": "kvfault-share",
        "GLM53_TEST_KV_DROP_INDEX_K": "kvfault-dropindex",
        "GLM53_TEST_KV_DROP_LATENT": "kvfault-droplatent",
        "GLM53_TEST_KV_LOG": str(tmp_path / "kv-events.jsonl"),
    }


@pytest.fixture(scope="module")
def faulty_single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv-fault-single")
    run = launch(tmp, "--topology", "single", env=_env(tmp))
    run.events = tmp / "kv-events.jsonl"
    yield run
    run.stop()


@pytest.fixture(scope="module")
def faulty_pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv-fault-pd")
    run = launch(tmp, "--topology", "pd", env=_env(tmp))
    run.events = tmp / "kv-events.jsonl"
    yield run
    run.stop()


def generate(run, rid=None, stream=False, prompt=PROMPT, tenant="demo", max_new=8):
    body = {
        "input_ids": prompt,
        "stream": stream,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }
    if rid:
        body["rid"] = rid
    return httpx.post(f"{run.url}/generate", json=body, timeout=120, headers=run.client_headers(tenant))


def faults(run, rid_prefix) -> list[dict]:
    events = [json.loads(line) for line in run.events.read_text().splitlines()] if run.events.exists() else []
    return [e for e in events if str(e.get("rid", "")).startswith(rid_prefix)]


def assert_reached_another_tenants_slot(run, rid_prefix, where, n=1):
    """The harness wrote a live slot of another owner into the request's row (not a no-op)."""
    fired = [e for e in faults(run, rid_prefix) if e.get("where") == where]
    hits = [e for e in fired if e["fault"] == "foreign_index" and e["owner"] not in (0, e["own"])]
    assert len(hits) >= n, fired


@contextlib.contextmanager
def another_tenant_decoding(run, tenant="demo", streams=2):
    """`tenant` keeps long generations decoding for the whole block (`streams` staggered loops of
    400-token streams, so that one is always running while another starts): its pages are live on
    every server holding them (PD decode keeps no prefix cache: only a running request owns pages
    there). Every one of its streams must end whole."""
    stop, first, ends = threading.Event(), threading.Event(), []

    def loop():
        body = {
            "input_ids": PROMPT,
            "stream": True,
            "sampling_params": {"max_new_tokens": OTHERS_NEW, "temperature": 0, "ignore_eos": True},
        }
        while not stop.is_set():
            with httpx.stream(
                "POST", f"{run.url}/generate", json=body, timeout=300, headers=run.client_headers(tenant)
            ) as r:
                text = []
                for chunk in r.iter_text():
                    first.set()
                    text.append(chunk)
                ends.append((r.status_code, "".join(text)))

    threads = []
    for _ in range(streams):
        threads.append(threading.Thread(target=loop))
        threads[-1].start()
        assert first.wait(120)
        time.sleep(0.8)  # staggered: the loops do not end and restart together
    yield
    stop.set()
    for t in threads:
        t.join(300)
    assert ends and all(status == 200 and '"error"' not in text and "[DONE]" in text for status, text in ends), [
        (status, text[-300:]) for status, text in ends if status != 200 or "[DONE]" not in text
    ]


def metric(url, name, headers, **labels) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30, headers=headers).text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def assert_contract_500(r, code):
    assert r.status_code == 500, (r.status_code, r.text[:500])
    err = r.json()["error"]  # the whole body is the contract error, no generated text anywhere
    assert err["code"] == code and err["type"] == "server_error", err
    assert "output_ids" not in r.text and '"text"' not in r.text


def _isolation_scenario(run, worker_name):
    since = datetime.now(UTC).isoformat()
    reference = generate(run)  # tenant demo's prompt, now cached: a live page demo owns
    assert reference.status_code == 200, reference.text
    expected = reference.json()["output_ids"]
    worker = run.worker(worker_name)
    before = metric(worker, "glm53_kv_isolation_violations_total", run.worker_headers())

    results = {}

    def normal(k):
        results[k] = generate(run)

    others = [threading.Thread(target=normal, args=(k,)) for k in range(3)]
    for t in others:
        t.start()
    # Tenant demo-b's rows get demo's cached slot written in.
    victim = generate(run, rid="kvfault-foreign-1", tenant="demo-b")
    streamed = generate(run, rid="kvfault-foreign-2", tenant="demo-b", stream=True)
    for t in others:
        t.join()

    assert_reached_another_tenants_slot(run, "kvfault-foreign-", "extend", n=2)
    assert_contract_500(victim, "kv_isolation_violation")
    assert_contract_500(streamed, "kv_isolation_violation")
    for k, r in results.items():
        assert r.status_code == 200 and r.json()["output_ids"] == expected, (k, r.text[:300])
    after = generate(run)
    assert after.status_code == 200 and after.json()["output_ids"] == expected
    b = generate(run, tenant="demo-b", rid="clean-demo-b")  # the victim tenant itself is still served
    assert b.status_code == 200 and b.json()["output_ids"] == expected
    assert httpx.get(f"{run.url}/health", timeout=30, headers=run.client_headers()).status_code == 200
    assert metric(worker, "glm53_kv_isolation_violations_total", run.worker_headers()) >= before + 2
    assert_the_operator_can_tell_who_was_affected(run, worker_name, since, [victim, streamed])


def assert_the_operator_can_tell_who_was_affected(run, worker_name, since, victims):
    """The worker logged each abort with the request's id, and one command names the victims'
    tenant with the ids its client was answered under, and no other tenant."""

    def violations():
        found = [
            e
            for e in worker_events(run, event="kv_isolation_violation")
            if str(e["rid"]).startswith("kvfault-foreign-")
        ]
        return found if len(found) >= len(victims) else []

    logged = eventually(violations)
    assert {e["worker"] for e in logged} == {worker_name} and len(logged) >= len(victims), worker_events(run)
    out = subprocess.run(
        [sys.executable, "-m", "glm53_serving.audit", "affected", "--run-dir", str(run.run_dir), "--since", since],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows = {line.split("\t")[0]: set(line.split("\t")[2].split()) for line in out.stdout.splitlines()}
    assert set(rows) == {"demo-b"}, out.stdout
    assert {r.headers["x-request-id"] for r in victims} <= rows["demo-b"], (out.stdout, victims)


def test_a_row_reaching_another_tenants_kv_fails_that_request_alone(faulty_single):
    _isolation_scenario(faulty_single, "server")
    checked = metric(
        faulty_single.worker("server"), "glm53_kv_owner_checked_requests_total", faulty_single.worker_headers()
    )
    assert checked > 0


def test_stale_row_residue_beyond_the_length_is_never_read(faulty_single):
    """Rows are reused without clearing (upstream); fill everything past the request's length
    with another tenant's live slot at every batch build: same output, no violation."""
    run, worker = faulty_single, faulty_single.worker("server")
    expected = generate(run).json()["output_ids"]
    before = metric(worker, "glm53_kv_isolation_violations_total", run.worker_headers())
    for k in range(2):
        r = generate(run, rid=f"kvfault-poison-{k}", tenant="demo-b")
        assert r.status_code == 200 and r.json()["output_ids"] == expected, r.text[:300]
    assert metric(worker, "glm53_kv_isolation_violations_total", run.worker_headers()) == before
    poisoned = [e for e in faults(run, "kvfault-poison-") if e.get("fault") == "poison_tail"]
    assert {e["where"] for e in poisoned} == {"extend", "decode"} and all(e["foreign"] for e in poisoned), poisoned


def test_a_foreign_index_at_a_decode_step_fails_that_request_alone(faulty_single):
    run = faulty_single
    expected = generate(run).json()["output_ids"]
    r = generate(run, rid="kvfault-decode-1", tenant="demo-b")
    assert_reached_another_tenants_slot(run, "kvfault-decode-1", "decode")
    assert_contract_500(r, "kv_isolation_violation")
    assert (
        metric(run.worker("server"), "glm53_kv_isolation_violations_total", run.worker_headers(), where="decode") >= 1
    )
    again = generate(run, tenant="demo-b")
    assert again.status_code == 200 and again.json()["output_ids"] == expected


@pytest.mark.skipif(PAGE == 1, reason="one-token pages are never partly filled")
def test_a_slot_of_another_tenants_partly_filled_page_fails_that_request_alone(faulty_single):
    """Owner tags are per page: the allocation hands demo-b the unwritten last slot of a page
    demo's running request holds a few tokens of (two owners on one page). demo-b's request
    fails with the contract's 500; demo's generations finish whole; both tenants are served
    after. A guard that let the claim take that page (or tagged slots, not pages) returns 200."""
    run = faulty_single
    expected = generate(run).json()["output_ids"]
    fired = []
    with another_tenant_decoding(run):
        for k in range(8):  # a request finds a partly filled page of demo's at most times
            r = generate(run, rid=f"kvfault-share-{k}", tenant="demo-b")
            hit = [e for e in faults(run, f"kvfault-share-{k}") if e.get("fault") == "shared_page"]
            if hit:
                fired.append(hit[0])
                assert_contract_500(r, "kv_isolation_violation")
                break
            assert r.status_code == 200 and r.json()["output_ids"] == expected, r.text[:300]
    assert fired, faults(run, "kvfault-share-")
    e = fired[0]
    assert e["owner"] not in (0, e["own"]) and 0 < e["filled"] < e["slot"] % PAGE, e  # unwritten, partly filled
    for tenant in ("demo", "demo-b"):
        again = generate(run, tenant=tenant)
        assert again.status_code == 200 and again.json()["output_ids"] == expected, again.text[:300]


def test_pd_decode_checks_owners_and_the_handoff_length_and_publishes_only_zeroed_pages(faulty_pd):
    run = faulty_pd
    decode = run.worker("decode-0")
    reference = generate(run)
    assert reference.status_code == 200, reference.text
    expected = reference.json()["output_ids"]

    # Decode's first step after the transfer finds another tenant's live slot in the row: that
    # request fails, and the tenant decoding beside it finishes untouched.
    with another_tenant_decoding(run):
        victim = generate(run, rid="kvfault-decode-pd", tenant="demo-b")
    assert_reached_another_tenants_slot(run, "kvfault-decode-pd", "decode")
    assert_contract_500(victim, "kv_isolation_violation")
    assert metric(decode, "glm53_kv_isolation_violations_total", run.worker_headers(), where="decode") >= 1

    # The transfer reports one prompt token fewer, or more, than decode pre-allocated (also on a
    # retraction re-bootstrap): aborted before decoding, with the contract's code.
    before = metric(decode, "glm53_kv_isolation_violations_total", run.worker_headers(), where="handoff")
    for rid, fault in (
        ("kvfault-short-1", "short_handoff"),
        ("kvfault-long-1", "long_handoff"),
        ("kvfault-rebootstrap-1", "rebootstrap_short_handoff"),  # once skipped by the check
    ):
        r = generate(run, rid=rid)
        assert [e["fault"] for e in faults(run, rid) if "fault" in e] == [fault]
        assert_contract_500(r, "kv_handoff_mismatch")
    assert metric(decode, "glm53_kv_isolation_violations_total", run.worker_headers(), where="handoff") >= before + 3
    # Decode logged each with the request's id (what `audit affected` reads: events.py)
    handed_off = {"kvfault-short-1", "kvfault-long-1", "kvfault-rebootstrap-1"}

    def mismatches():
        found = {e["rid"] for e in worker_events(run, event="kv_handoff_mismatch", worker="decode-0")}
        return found if found >= handed_off else set()

    assert eventually(mismatches) >= handed_off, worker_events(run, event="kv_handoff_mismatch")

    # The servers stay up, and a burst of one tenant's failing requests does not make the router
    # refuse another tenant (no circuit breaker, no retries: launch/cpu.toml; upstream's defaults
    # answered everyone 503 for about a minute here).
    for name in ("prefill-0", "decode-0"):
        assert httpx.get(f"{run.worker(name)}/health", timeout=30, headers=run.worker_headers()).status_code == 200
    burst = {}

    def fail(i):
        burst[i] = generate(run, rid=f"kvfault-decode-burst-{i}", tenant="demo-b").status_code

    with another_tenant_decoding(run):
        threads = [threading.Thread(target=fail, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert_reached_another_tenants_slot(run, "kvfault-decode-burst-", "decode", n=6)
    assert sorted(burst.values()) == [500] * 6, burst
    for _ in range(3):
        again = generate(run)
        assert again.status_code == 200 and again.json()["output_ids"] == expected, again.text[:300]

    # Ordering: at the moment decode sends a destination's page indices, every page reads zero.
    events = [json.loads(line) for line in run.events.read_text().splitlines()]
    published = [e for e in events if e.get("event") == "publish"]
    assert len(published) >= 4, events
    assert all(e["all_zero"] for e in published), [e for e in published if not e["all_zero"]]
    if TOPOLOGY.model.preset in DSA_PRESETS:  # the index-K rows were looked at too
        assert all(e["index_k_layers"] > 0 for e in published), published


def test_pd_decode_refuses_a_transfer_that_left_latent_or_index_k_pages_unwritten(faulty_pd):
    """The length prefill reports is right, but the transfer left the prompt's last page zero on
    decode: its index-K bytes (DSA's indexer keys travel on a channel of their own) or its
    latent rows. Decode's handoff check finds the unwritten slots and fails the request before
    its first decode step; without that check it decodes over them and answers 200."""
    run = faulty_pd
    expected = generate(run).json()["output_ids"]
    kinds = [("kvfault-droplatent-1", "dropped_latent_page", "KV slots")]
    if TOPOLOGY.model.preset in DSA_PRESETS:
        kinds.append(("kvfault-dropindex-1", "dropped_index_k_page", "index-K slots"))
    for rid, fault, what in kinds:
        r = generate(run, rid=rid)
        dropped = [e for e in faults(run, rid) if e.get("fault") == fault]
        assert dropped and dropped[0]["buffers"] > 0 and dropped[0]["slots"] > 0, faults(run, rid)
        assert_contract_500(r, "kv_handoff_mismatch")

        def logged(rid=rid):
            return [e for e in worker_events(run, event="kv_handoff_mismatch", worker="decode-0") if e["rid"] == rid]

        event = eventually(logged)[0]
        assert event["unwritten"] == {what: dropped[0]["slots"]}, event
    again = generate(run)
    assert again.status_code == 200 and again.json()["output_ids"] == expected, again.text[:300]


def test_pd_prefill_side_violation_fails_the_request_at_once_not_at_decodes_timeout(faulty_pd):
    """Prefill's owner check fails a request (another tenant's live slot in its row). Upstream
    only marks the transfer failed on prefill: decode, its pages pre-allocated, waited 300 s for
    KV that never came, and the client with it. Prefill now fails the transfer towards decode."""
    run = faulty_pd
    prefill = run.worker("prefill-0")
    expected = generate(run).json()["output_ids"]  # demo's prompt now cached on prefill: a live foreign slot
    before = metric(prefill, "glm53_kv_isolation_violations_total", run.worker_headers(), where="extend")
    for stream in (False, True):
        t0 = time.monotonic()
        r = generate(run, rid=f"kvfault-foreign-prefill-{int(stream)}", tenant="demo-b", stream=stream)
        took = time.monotonic() - t0
        assert_reached_another_tenants_slot(run, f"kvfault-foreign-prefill-{int(stream)}", "extend")
        assert_contract_500(r, "kv_isolation_violation")
        assert took < 30, f"answered after {took:.1f} s: decode waited for its transfer timeout"
    assert metric(prefill, "glm53_kv_isolation_violations_total", run.worker_headers(), where="extend") >= before + 2
    for tenant in ("demo-b", "demo"):  # decode released the destination; both tenants are served
        again = generate(run, tenant=tenant)
        assert again.status_code == 200 and again.json()["output_ids"] == expected, again.text[:300]

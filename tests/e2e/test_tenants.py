"""Tenants end to end, on real servers through the real gateway and router: identity at the
gateway, verified assertions at the workers, server-side cache namespaces, owned sessions and
requests, the trusted PD handoff, operator-only control endpoints, and session affinity."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from glm53_serving import tenants
from glm53_serving.gateway.app import routing_key
from glm53_serving.tenant_guard import ROUTES, Access
from tests.e2e.deployment import LONG, MODEL, config_text, set_keys
from tests.e2e.launcher import SlowStream, auth, launch
from tests.e2e.test_admission import metric, over_length
from tests.e2e.test_robustness import serves_normally

pytestmark = pytest.mark.e2e

ENDPOINTS = ["/generate", "/v1/completions", "/v1/chat/completions"]
GEN = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}


def assert_error(r, status, code, param=None):
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["code"] == code and isinstance(err["message"], str) and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def topology(single, pd, name):
    return single if name == "single" else pd


# --- identity --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["single", "pd"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_missing_or_unknown_key_is_401_at_the_gateway_and_nothing_is_forwarded(single, pd, name, endpoint):
    run = topology(single, pd, name)
    workers = [p["url"] for p in run.info["processes"] if p["name"] in ("server", "prefill-0", "decode-0")]
    before = [metric(w, "sglang:http_requests_total", endpoint=endpoint) for w in workers]
    body = over_length(endpoint, False, n_prompt=4)
    for headers in (
        {},
        {"Authorization": "Bearer g53-not-a-key"},
        {"Authorization": "Basic abc"},
        run.worker_headers(),
    ):  # a worker assertion is not an API key
        assert_error(httpx.post(f"{run.url}{endpoint}", json=body, headers=headers, timeout=30), 401, "invalid_api_key")
    assert [metric(w, "sglang:http_requests_total", endpoint=endpoint) for w in workers] == before
    assert (
        metric(
            run.info["operator_url"], "glm53_gateway_requests_total", tenant="-", status="401", reason="invalid_api_key"
        )
        >= 4
    )
    before_ok = metric(
        run.info["operator_url"], "glm53_gateway_requests_total", tenant="demo-b", endpoint=endpoint, status="200"
    )
    r = httpx.post(f"{run.url}{endpoint}", json=body, headers=run.client_headers("demo-b"), timeout=120)
    assert r.status_code == 200, r.text
    assert (
        metric(
            run.info["operator_url"], "glm53_gateway_requests_total", tenant="demo-b", endpoint=endpoint, status="200"
        )
        == before_ok + 1
    )


@pytest.mark.parametrize("name", ["single", "pd"])
def test_tenant_metadata_is_the_operators_and_each_tenant_sees_only_its_own_usage(single, pd, name):
    """The gateway's series name every tenant: served on the operator's listener, never on the
    client port; a tenant reads its own counts through /v1/usage with its key."""
    run = topology(single, pd, name)
    body = over_length("/generate", False, n_prompt=4)
    for tenant in ("demo", "demo-b"):
        r = httpx.post(f"{run.url}/generate", json=body, headers=run.client_headers(tenant), timeout=120)
        assert r.status_code == 200, r.text
    for headers in ({}, run.client_headers("demo"), run.worker_headers("admin")):
        r = httpx.get(f"{run.url}/metrics", headers=headers, timeout=30)
        assert r.status_code == 404 and "demo" not in r.text, r.text
    text = httpx.get(f"{run.info['operator_url']}/metrics", timeout=30).text
    assert 'tenant="demo"' in text and 'tenant="demo-b"' in text
    usage = httpx.get(f"{run.url}/v1/usage", headers=run.client_headers("demo-b"), timeout=30).json()
    assert usage["tenant"] == "demo-b" and "'demo'" not in str(usage)
    assert any(r["endpoint"] == "/generate" and r["status"] == 200 and r["requests"] >= 1 for r in usage["requests"])
    assert_error(httpx.get(f"{run.url}/v1/usage", timeout=30), 401, "invalid_api_key")


def forged_credentials(run) -> dict[str, dict]:
    now = int(time.time())
    import jwt

    key = tenants.load_assertion_key(run.info["tenants"]["assertion_key_file"])
    aud = tenants.audience(run.info["tenants"]["deployment"])

    def bearer(claims, signing_key=key, alg="HS256"):
        claims = {"sub": "demo", "aud": aud, "iat": now, "exp": now + 60, "jti": "j", **claims}
        return {"Authorization": f"Bearer {jwt.encode(claims, signing_key, alg)}"}

    return {
        "none": {},
        "client_api_key": run.client_headers(),
        "other_deployments_key": bearer({}, b"z" * 64),
        # the right key, minted for another deployment that shares it by mistake
        "other_deployments_audience": bearer({"aud": tenants.audience("staging")}),
        "expired": bearer({"iat": now - 900, "exp": now - 600}),
        "unsigned": bearer({}, None, "none"),
        # signed with the deployment's key but living longer than a tenant assertion may
        "ten_years": bearer({"exp": now + 10 * 365 * 86400}),
        "admin_ten_years": bearer({"sub": tenants.ADMIN, "exp": now + 10 * 365 * 86400}),
        "no_jti": bearer({"jti": None}),
        "reserved_tenant": bearer({"sub": tenants.INTERNAL}),
    }


@pytest.mark.parametrize("worker", ["server", "prefill-0", "decode-0"])
def test_a_worker_reached_without_the_gateway_cannot_claim_a_tenant(single, pd, worker):
    run = single if worker == "server" else pd
    url = run.worker(worker)
    for headers in forged_credentials(run).values():
        for endpoint in ENDPOINTS:
            r = httpx.post(
                f"{url}{endpoint}", json=over_length(endpoint, False, n_prompt=4), headers=headers, timeout=30
            )
            assert_error(r, 401, "invalid_api_key")
    assert metric(url, "glm53_rejections_total", reason="invalid_api_key") >= 15
    # the control: the same request with the gateway's real assertion passes authentication
    r = httpx.post(
        f"{url}/generate", json=over_length("/generate", False, n_prompt=4), headers=run.worker_headers(), timeout=30
    )
    assert r.status_code != 401, r.text
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # open


def test_only_the_gateway_and_the_workers_hold_the_assertion_key(pd):
    """The router forwards assertions and never checks one: it is not given the key."""
    holders = {p["name"]: tenants.KEY_FILE_ENV in psutil.Process(p["pid"]).environ() for p in pd.info["processes"]}
    assert holders == {"prefill-0": True, "decode-0": True, "router": False, "gateway": True}, holders


# --- namespaces ------------------------------------------------------------------------------


def cached(run, ids, tenant, **extra):
    r = httpx.post(
        f"{run.url}/generate",
        headers=run.client_headers(tenant),
        timeout=120,
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
            **extra,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"], r.json()["output_ids"]


CHANCE_PREFIX_HIT = 4  # P(4 random tokens in [5, 500) match a cached prefix) < 1e-8 per prompt


@pytest.mark.parametrize("spoof", ["cache_salt", "extra_key", "both"])
def test_prefix_cache_hits_within_a_tenant_and_never_across(single, spoof):
    ids = [random.Random(uuid.uuid4().int).randrange(5, 500) for _ in range(300)]  # new to the cache
    key = tenants.load_assertion_key(single.info["tenants"]["assertion_key_file"])
    a_salt = tenants.cache_salt(key, "demo")  # even tenant A's real namespace, leaked to B, is no way in
    body = {
        "cache_salt": {"cache_salt": a_salt},
        "extra_key": {"extra_key": a_salt},
        "both": {"cache_salt": a_salt, "extra_key": "x"},
    }[spoof]
    # A few tokens may hit by chance: other tests' random prompts share the namespaces and the
    # radix cache matches single tokens (CI once saw 1). A shared namespace would hit >= 256.
    assert cached(single, ids, "demo")[0] < CHANCE_PREFIX_HIT
    hit, out_a = cached(single, ids, "demo")
    assert hit >= 256, hit  # within a tenant, caching works (so the miss below is not caching being off)
    miss, out_b = cached(single, ids, "demo-b", **body)
    assert miss < CHANCE_PREFIX_HIT, miss  # B never lands in A's namespace
    hit_b, out_b2 = cached(single, ids, "demo-b")
    assert hit_b >= 256 and out_b == out_a == out_b2  # B's own namespace caches; the output is the model's


# --- owned sessions and requests -------------------------------------------------------------


def test_a_session_belongs_to_the_tenant_that_opened_it(single):
    url = single.url
    r = httpx.post(
        f"{url}/open_session", json={"capacity_of_str_len": 4000}, headers=single.client_headers("demo"), timeout=30
    )
    assert r.status_code == 200, r.text
    sid = r.json()
    in_session = {**GEN, "session_params": {"id": sid}}
    b = single.client_headers("demo-b")
    assert_error(httpx.post(f"{url}/generate", json=in_session, headers=b, timeout=30), 404, "not_found", "session_id")
    assert_error(
        httpx.post(
            f"{url}/generate",
            json={**in_session, "session_params": {"id": sid, "rid": None, "offset": 0, "replace": True}},
            headers=b,
            timeout=30,
        ),
        404,
        "not_found",
    )  # branch
    assert_error(httpx.post(f"{url}/close_session", json={"session_id": sid}, headers=b, timeout=30), 404, "not_found")
    missing = httpx.post(f"{url}/close_session", json={"session_id": uuid.uuid4().hex}, headers=b, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["message"].startswith("No session")  # same answer
    a = single.client_headers("demo")
    ok = httpx.post(f"{url}/generate", json=in_session, headers=a, timeout=120)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4, ok.text
    assert httpx.post(f"{url}/close_session", json={"session_id": sid}, headers=a, timeout=30).status_code == 200


def stream_tokens(url, headers, rid, n, seen: list, started: threading.Event, on_first=None):
    with httpx.stream(
        "POST",
        f"{url}/generate",
        headers=headers,
        timeout=300,
        json={
            "rid": rid,
            "input_ids": [9] * 16,
            "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        },
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.append(json.loads(line[6:]))
                if on_first and not started.is_set():
                    on_first()
                started.set()
    started.set()


def test_a_tenant_aborts_only_its_own_requests(single):
    url = single.url
    a, b = single.client_headers("demo"), single.client_headers("demo-b")
    rid = f"tenant-a-{uuid.uuid4().hex}"
    seen, started = [], threading.Event()
    t = threading.Thread(target=stream_tokens, args=(url, a, rid, 64, seen, started))
    t.start()
    assert started.wait(120)
    r = httpx.post(f"{url}/abort_request", json={"rid": rid}, headers=b, timeout=30)
    assert r.status_code == 200  # as for any rid B does not own: nothing said, nothing done
    assert_error(
        httpx.post(f"{url}/abort_request", json={"abort_all": True}, headers=b, timeout=30),
        403,
        "permission_denied",
        "abort_all",
    )
    t.join(300)
    assert seen[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert seen[-1]["meta_info"]["completion_tokens"] == 64  # B's aborts did not touch it
    # A may abort its own. The abort races the request's end (400 tokens take ~1 s here), so it
    # is sent from the reading thread at the first chunk; a try the request won anyway is retried.
    for attempt in range(5):  # noqa: B007 - reported after the loop
        rid2, seen2, started2, aborted = f"tenant-a-{uuid.uuid4().hex}", [], threading.Event(), []

        def abort(rid2=rid2, aborted=aborted):
            aborted.append(httpx.post(f"{url}/abort_request", json={"rid": rid2}, headers=a, timeout=30))

        stream_tokens(url, a, rid2, LONG, seen2, started2, on_first=abort)
        assert aborted and aborted[0].status_code == 200, aborted
        assert seen2, "the stream produced no chunk"
        if seen2[-1]["meta_info"]["finish_reason"]["type"] == "abort":
            break
        assert seen2[-1]["meta_info"]["finish_reason"]["type"] == "length"  # finished before the abort arrived
    assert seen2[-1]["meta_info"]["finish_reason"]["type"] == "abort", f"{attempt + 1} tries ended before the abort"
    assert seen2[-1]["meta_info"]["completion_tokens"] < LONG


def test_stored_responses_are_not_a_tenant_api(single):
    # Upstream's Responses API stores responses by id with no owner: any tenant could read
    # another's. It is operator-only (and the store is refused at start-up with tenants).
    url = single.worker("server")
    for method, path in (
        ("GET", f"/v1/responses/resp_{uuid.uuid4().hex}"),
        ("POST", "/v1/responses/resp_x/cancel"),
        ("POST", "/v1/responses"),
    ):
        assert_error(
            httpx.request(method, f"{url}{path}", headers=auth(url, "demo-b"), timeout=30), 403, "permission_denied"
        )
    assert (
        httpx.get(f"{single.url}/v1/responses/resp_x", headers=single.client_headers(), timeout=30).status_code == 404
    )


# --- control endpoints -------------------------------------------------------------------------


def test_control_endpoints_need_the_operators_assertion(single):
    url = single.worker("server")
    admin_paths = sorted(p for p, a in ROUTES.items() if a is Access.ADMIN and "{" not in p)
    assert len(admin_paths) > 50
    for path in admin_paths:
        for method in ("GET", "POST"):
            assert_error(httpx.request(method, f"{url}{path}", timeout=30), 401, "invalid_api_key")
            assert_error(
                httpx.request(method, f"{url}{path}", headers=auth(url, "demo"), timeout=30), 403, "permission_denied"
            )
    before = metric(url, "sglang:num_requests_total")
    r = httpx.post(f"{url}/flush_cache", headers=auth(url, "admin"), timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{url}/server_info", headers=auth(url, "admin"), timeout=30).json()["glm53_serving"]["active"]
    serves_normally(single.url)
    assert metric(url, "sglang:num_requests_total") == before + 1  # none of the refused calls ran


# --- trusted PD handoff ------------------------------------------------------------------------


@pytest.mark.parametrize("worker", ["prefill-0", "decode-0"])
@pytest.mark.parametrize("host", ["2.2.2.2", "10.9.9.9", "127.0.0.1"], ids=["fake", "foreign", "wrong-port"])
def test_a_fake_or_foreign_bootstrap_host_is_refused_straight_to_a_pd_worker(pd, worker, host):
    url = pd.worker(worker)
    t0 = time.monotonic()
    r = httpx.post(
        f"{url}/generate",
        headers=auth(url),
        timeout=30,
        json={**GEN, "bootstrap_host": host, "bootstrap_port": 1, "bootstrap_room": 77},
    )
    assert time.monotonic() - t0 < 2.0
    assert_error(r, 403, "permission_denied", "bootstrap_host")
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    serves_normally(pd.url)


@pytest.mark.parametrize("field", ["bootstrap_host", "bootstrap_room", "bootstrap_port"])
def test_clients_cannot_set_handoff_fields_at_the_gateway(pd, field):
    value = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 1, "bootstrap_port": 8998}[field]
    r = httpx.post(f"{pd.url}/generate", headers=pd.client_headers(), timeout=30, json={**GEN, field: value})
    assert_error(r, 400, "invalid_request_error", field)


def test_the_router_replaces_client_handoff_fields(pd):
    # Straight to the router (no gateway), a client's fake bootstrap host is overwritten by the
    # router's own pairing: the answer is the model's real output, not decode over unwritten pages.
    router = pd.worker("router")
    honest = httpx.post(f"{router}/generate", headers=auth(router), timeout=120, json=GEN)
    faked = httpx.post(
        f"{router}/generate",
        headers=auth(router),
        timeout=120,
        json={**GEN, "bootstrap_host": "2.2.2.2", "bootstrap_port": 8998, "bootstrap_room": 5},
    )
    assert honest.status_code == faked.status_code == 200, faked.text
    assert faked.json()["output_ids"] == honest.json()["output_ids"]


# --- session affinity (two decode workers) -------------------------------------------------------


@pytest.fixture(scope="module")
def pd2(tmp_path_factory):
    d = tmp_path_factory.mktemp("pd2")
    cfg = d / "pd2.toml"
    cfg.write_text(set_keys(config_text(), "decode", count=2))
    run = launch(d / "run", "--config", str(cfg))
    yield run
    run.stop()


def per_decode(run, requests: list[dict]) -> list[int]:
    decodes = [run.worker("decode-0"), run.worker("decode-1")]
    before = [metric(d, "sglang:num_requests_total") for d in decodes]
    for headers in requests:
        r = httpx.post(f"{run.url}/generate", json=GEN, headers={**run.client_headers(), **headers}, timeout=120)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
    return [int(metric(d, "sglang:num_requests_total") - b) for d, b in zip(decodes, before)]


def test_affinity_pins_a_session_to_one_decode_worker(pd2):
    counts = per_decode(pd2, [{"x-session-affinity": "agent-session-1"}] * 20)
    assert sorted(counts) == [0, 20], counts


def test_different_sessions_and_no_session_spread_over_the_workers(pd2):
    counts = per_decode(pd2, [{"x-session-affinity": f"s-{i}"} for i in range(20)])
    assert min(counts) >= 4, counts
    counts = per_decode(pd2, [{}] * 20)
    assert min(counts) >= 4, counts


def test_affinity_ids_are_scoped_by_tenant():
    assert routing_key("demo", "s1") != routing_key("demo-b", "s1")
    assert routing_key("demo", "s1") == routing_key("demo", "s1")


# --- no cross-tenant denial of service ----------------------------------------------------------


def bad_requests(run):
    """What one tenant can throw at the deployment: every kind of request that is refused."""
    b, url = run.client_headers("demo-b"), run.url
    return [
        lambda: httpx.post(
            f"{url}/generate", json=over_length("/generate", True), headers=b, timeout=30
        ),  # 400 gateway
        lambda: httpx.post(
            f"{url}/v1/chat/completions", json=over_length("/v1/chat/completions", False), headers=b, timeout=30
        ),
        lambda: httpx.post(
            f"{url}/generate", json=GEN, headers={"Authorization": "Bearer g53-stolen"}, timeout=30
        ),  # 401
        lambda: httpx.post(f"{url}/generate", json={**GEN, "input_ids": [5, -1]}, headers=b, timeout=30),  # 400 worker
        lambda: httpx.post(
            f"{url}/v1/chat/completions",
            headers=b,
            timeout=30,
            json={  # 400 worker, through the router
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "temperature": -1,
            },
        ),
        lambda: httpx.post(f"{url}/generate", json={**GEN, "bootstrap_host": "2.2.2.2"}, headers=b, timeout=30),
    ]


def test_one_tenants_burst_of_bad_requests_does_not_deny_service_to_another(pd):
    expected = httpx.post(f"{pd.url}/generate", json=GEN, headers=pd.client_headers("demo"), timeout=120).json()[
        "output_ids"
    ]
    stop, refused = threading.Event(), []

    def burst():
        kinds = bad_requests(pd)
        while not stop.is_set():
            for send in kinds:
                r = send()
                try:
                    code = r.json()["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = None
                refused.append((r.status_code, code))

    attackers = [threading.Thread(target=burst) for _ in range(3)]
    for t in attackers:
        t.start()
    try:
        outcomes = []
        for _ in range(15):
            r = httpx.post(f"{pd.url}/generate", json=GEN, headers=pd.client_headers("demo"), timeout=120)
            outcomes.append((r.status_code, r.json().get("output_ids")))
    finally:
        stop.set()
        for t in attackers:
            t.join(60)
    assert len(refused) >= 30, len(refused)
    assert outcomes == [(200, expected)] * 15  # 100% success, correct output, during the burst
    assert all(400 <= status < 500 and code for status, code in refused), set(refused)
    assert {400, 401} <= {status for status, _ in refused}


# --- key lifecycle on a running deployment -----------------------------------------------------


def tenants_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "glm53_serving.tenants", *map(str, args)], capture_output=True, text=True, check=True
    )


def seconds_until(run, key, status, bound_s=5.0) -> float:
    """How long until a request with `key` gets `status` at the gateway (fails past `bound_s`)."""
    t0 = time.monotonic()
    while True:
        r = httpx.post(f"{run.url}/generate", json=GEN, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        if r.status_code == status:
            if status == 401:
                assert_error(r, 401, "invalid_api_key")
            return time.monotonic() - t0
        assert time.monotonic() - t0 < bound_s, f"still {r.status_code} after {bound_s} s: {r.text[:300]}"
        time.sleep(0.05)


def test_keys_are_added_rotated_and_retired_on_a_running_gateway_without_dropping_a_stream(single):
    """No restart: a new tenant is served within seconds, a retired key is refused within
    seconds, and a stream that began with the retired key runs to its end."""
    run = single
    f = Path(run.info["tenants"]["file"])
    good = f.read_bytes()
    gateway = next(p["pid"] for p in run.info["processes"] if p["name"] == "gateway")
    try:
        old = tenants_cli("add", f, "rotator").stdout.strip()
        took = {"add": seconds_until(run, old, 200)}
        new = tenants_cli("rotate", f, "rotator").stdout.strip()
        took["rotate"] = seconds_until(run, new, 200)
        assert seconds_until(run, old, 200) < 1  # both keys during the move
        stream = SlowStream(run.url, {"Authorization": f"Bearer {old}"}).started()
        tenants_cli("retire", f, tenants.key_id(tenants.hash_key(old)))
        took["retire"] = seconds_until(run, old, 401)
        assert not stream.done, "the stream ended before the key was retired: make it longer"
        stream.assert_whole()  # every token, after the key was retired too
        print(f"key lifecycle on a running gateway, seconds until in force: {took}")

        # A broken file never replaces the good one; SIGHUP reloads at once.
        before = metric(run.info["operator_url"], "glm53_gateway_tenants_reloads_total", result="error")
        f.write_text("[tenants\n")
        os.kill(gateway, signal.SIGHUP)
        deadline = time.monotonic() + 5
        while metric(run.info["operator_url"], "glm53_gateway_tenants_reloads_total", result="error") == before:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (
            seconds_until(run, new, 200) < 1 and seconds_until(run, run.client_headers()["Authorization"][7:], 200) < 1
        )
    finally:
        f.write_bytes(good)  # rotator gone, demo and demo-b as they were
    assert seconds_until(run, new, 401) < 5


def test_a_tenant_over_its_fair_share_gets_429_while_another_is_served(single):
    """demo-b's own limit (one request at a time, no queue), set in the running gateway's
    tenants file: its concurrent requests beyond one are 429 with Retry-After, never 5xx, while
    demo's are all served."""
    run = single
    f = Path(run.info["tenants"]["file"])
    good = f.read_bytes()
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}}
    try:
        f.write_text(good.decode() + '\n[tenants."demo-b".limits]\nconcurrent = 1\n')
        time.sleep(2.5)  # the gateway's poll (1 s)
        results = []

        def send(tenant):
            r = httpx.post(f"{run.url}/generate", json=body, headers=run.client_headers(tenant), timeout=120)
            results.append((tenant, r))

        threads = [threading.Thread(target=send, args=(t,)) for t in ["demo-b"] * 4 + ["demo"] * 3]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        b = [r for tenant, r in results if tenant == "demo-b"]
        a = [r for tenant, r in results if tenant == "demo"]
        assert all(r.status_code == 200 for r in a), [r.text[:200] for r in a]
        assert 1 <= sum(r.status_code == 200 for r in b) < 4 and all(r.status_code in (200, 429) for r in b)
        for r in b:
            if r.status_code == 429:
                err = assert_error(r, 429, "rate_limit_exceeded")
                assert (
                    r.headers["retry-after"] == str(err["retry_after_s"])
                    and "concurrent requests (1)" in err["message"]
                )
        assert metric(run.info["operator_url"], "glm53_gateway_requests_total", tenant="demo-b", status="429") >= 1
    finally:
        f.write_bytes(good)
        time.sleep(2.5)
    assert (
        httpx.post(f"{run.url}/generate", json=body, headers=run.client_headers("demo-b"), timeout=120).status_code
        == 200
    )

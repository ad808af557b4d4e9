"""The gateway's upstream hop against a real HTTP server standing in for the router: explicit
timeouts, an unreachable upstream, chunk-by-chunk streaming, a client's disconnect closing the
upstream stream. Each failure is a JSON body with the contract's keys."""

import asyncio
import hashlib
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from glm53_serving import audit, tenants
from glm53_serving.admission import Limits
from glm53_serving.gateway.app import GatewayConfig, build_app
from glm53_serving.models import tiny
from glm53_serving.topology import free_port

BODY = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
STREAMS_ENDED = []  # how each upstream stream ended: "done", or "cut" when its client went away


async def generate(request):
    body = await request.json()
    delay = float(request.query_params.get("delay", 0))
    if body.get("stream"):

        async def events():
            ended = "cut"
            try:
                for i in range(5):
                    yield f"data: {i}\n\n".encode()
                    await asyncio.sleep(delay)
                yield b"data: [DONE]\n\n"
                ended = "done"
            finally:
                STREAMS_ENDED.append(ended)

        return StreamingResponse(events(), media_type="text/event-stream")
    await asyncio.sleep(delay)
    if "error" in request.query_params:  # an upstream error in a shape outside our contract
        code = request.query_params["error"]
        return JSONResponse({"error": {"message": f"upstream says {code}", "code": code}}, status_code=400)
    meta = {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}
    seen = {k: v for k, v in request.headers.items() if k.startswith("x-")}  # what reached the worker
    return JSONResponse({"text": "ok", "output_ids": [7], "meta_info": meta, "peer": request.client.port, "seen": seen})


def serve(app, operator_port: int | None = None):
    """`app` on a real uvicorn in a thread (the gateway's own HTTP stack: httptools, uvloop), on
    the client socket and, given its port, the operator's (as gateway/__main__.py serves it)."""
    port = free_port()
    ports = [port, *([operator_port] if operator_port else [])]
    sockets = [socket.create_server(("127.0.0.1", p)) for p in ports]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", loop="uvloop", http="httptools"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def upstream():
    yield from serve(Starlette(routes=[Route("/generate", generate, methods=["POST"])]))


OPERATOR_PORT = 9100  # TestClient: a request to http://testserver:9100 comes in on the operator socket


def gateway_config(upstream_url: str, timeout_s: float = 30.0, **over) -> GatewayConfig:
    return GatewayConfig(
        upstream=upstream_url,
        model_path=str(tiny.ensure()),
        served_model_name="glm53-tiny",
        context_length=512,
        limits=Limits(506, 510, 512),
        max_body_bytes=8 * 1024 * 1024,
        upstream_timeout_s=timeout_s,
        connect_timeout_s=2.0,
        **{"operator_port": OPERATOR_PORT, **over},
    )


def gateway(upstream_url: str, timeout_s: float = 30.0) -> TestClient:
    return TestClient(build_app(gateway_config(upstream_url, timeout_s)))


def test_an_upstream_slower_than_the_timeout_is_a_504_with_the_contract_body(upstream):
    with gateway(upstream, timeout_s=0.5) as gw:
        t0 = time.monotonic()
        r = gw.post("/generate?delay=3", json=BODY)
        took = time.monotonic() - t0
        assert r.status_code == 504 and took < 3, (r.status_code, took)
        assert r.json()["error"] == {
            "message": "The model server did not answer in time.",
            "type": "server_error",
            "param": None,
            "code": "upstream_timeout",
        }
        assert gw.post("/generate", json=BODY).json()["text"] == "ok"  # and the next one is served


def test_an_unreachable_upstream_is_a_502_with_the_contract_body():
    with gateway(f"http://127.0.0.1:{free_port()}") as gw:
        r = gw.post("/generate", json=BODY)
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["code"] == "upstream_unavailable" and err["type"] == "server_error" and err["param"] is None
        assert err["message"].startswith("The model server is unreachable")


def test_a_gateway_failure_is_a_500_with_the_contract_body_and_other_routes_still_answer(upstream):
    app = build_app(gateway_config(upstream))

    async def broken(*_args):
        raise RuntimeError("a bug in the gateway")

    app.gateway.judge_generation = broken
    with TestClient(app, raise_server_exceptions=False) as gw:
        r = gw.post("/generate", json=BODY)
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        assert r.json()["error"] == {
            "message": "The gateway failed on this request.",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
        assert 'reason="internal_error"' in gw.get(f"http://testserver:{OPERATOR_PORT}/metrics").text
        (model,) = gw.get("/v1/models").json()["data"]
        assert (model["max_model_len"], model["max_input_tokens"]) == (510, 505)  # what is served
        assert gw.get("/generate").status_code == 405 and gw.post("/nowhere").status_code == 404


def test_a_stream_passes_through_chunk_by_chunk(upstream):
    with gateway(upstream) as gw:
        with gw.stream("POST", "/generate?delay=0.3", json={**BODY, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            first_at, t0, chunks = None, time.monotonic(), []
            for chunk in r.iter_bytes():
                first_at = first_at or time.monotonic() - t0
                chunks.append(chunk)
        # The first event arrives while the upstream is still sleeping between the others.
        assert first_at < 1.0, first_at
        assert b"".join(chunks) == b"".join(f"data: {i}\n\n".encode() for i in range(5)) + b"data: [DONE]\n\n"


def upstream_stream_ended(timeout_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while not STREAMS_ENDED and time.monotonic() < deadline:
        time.sleep(0.05)
    return STREAMS_ENDED


def test_a_client_disconnect_closes_the_upstream_stream(upstream):
    """Leaving mid-stream must reach the upstream (there: the router and the worker abort the
    request); a stream read to its end must be released whole, not cut."""
    served = serve(build_app(gateway_config(upstream)))
    url = next(served)
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            STREAMS_ENDED.clear()
            with client.stream("POST", "/generate?delay=0.2", json={**BODY, "stream": True}) as r:
                assert r.status_code == 200
                assert next(r.iter_bytes()).startswith(b"data: 0")
            # Closed after the first event, while the upstream sleeps before the next ones.
            assert upstream_stream_ended() == ["cut"]

            STREAMS_ENDED.clear()
            with client.stream("POST", "/generate?delay=0.01", json={**BODY, "stream": True}) as r:
                whole = b"".join(r.iter_bytes())
            assert whole.endswith(b"data: [DONE]\n\n") and whole.count(b"data: ") == 6
            assert upstream_stream_ended() == ["done"]
    finally:
        next(served, None)


def test_the_gateway_process_freezes_its_start_up_heap():
    # A full collection over the unfrozen heap stalls every stream for ~440 ms (measured). Run in
    # a child: freezing this test process's heap would change what other tests see.
    import subprocess
    import sys

    code = (
        "import gc\n"
        "from glm53_serving.gateway.__main__ import built\n"
        "from tests.unit.test_gateway_upstream import gateway_config\n"
        "built(gateway_config('http://127.0.0.1:9', 5.0))\n"
        "print(gc.get_freeze_count(), len(gc.get_objects()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    frozen, collectable = map(int, out.stdout.split())
    assert frozen > 100_000 and collectable < frozen / 10, out.stdout


def test_the_gateway_times_the_upstream_share_of_each_answer(upstream):
    """What bench.serving subtracts from the client's latency to get the gateway's own: the time
    to the first chunk and to the last byte, for answers read to their end only; and the gateway's
    own time before forwarding; read as the bench reads them."""
    from glm53_serving.bench.serving import upstream_timing

    operator_port = free_port()
    served = serve(build_app(gateway_config(upstream, operator_port=operator_port)), operator_port)
    url = next(served)
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            with client.stream("POST", "/generate?delay=0.3", json={**BODY, "stream": True}) as r:
                next(r.iter_bytes())  # and gone: not an answer read to its end
            upstream_stream_ended()
            t0 = time.monotonic()
            whole = client.post("/generate?delay=0.1", json={**BODY, "stream": True}).content
            took = time.monotonic() - t0
            assert whole.endswith(b"data: [DONE]\n\n")
            t = upstream_timing(f"http://127.0.0.1:{operator_port}")
            assert client.get("/metrics").status_code == 404  # never on the client port
    finally:
        next(served, None)
    (admit_s, admit_n), (first_s, first_n), (whole_s, whole_n) = t.values()
    assert admit_n == first_n == 2 and whole_n == 1, t  # the cut stream had its first chunk, not its end
    assert 0 < admit_s < 0.1, t
    assert first_s < 0.2 and 0.5 <= whole_s <= took, (t, took)  # events 0.1 s apart after the first


KEY = b"k" * 64
TENANT_KEYS = {"acme": "g53-acme-key", "beta": "g53-beta-key"}


def tenant_gateway(upstream_url: str) -> TestClient:
    by_hash = {hashlib.sha256(k.encode()).hexdigest(): t for t, k in TENANT_KEYS.items()}
    cfg = gateway_config(upstream_url, tenants=tenants.TenantsFile(by_hash), assertion_key=KEY)
    return TestClient(build_app(cfg))


def auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer {TENANT_KEYS[tenant]}"}


def test_metrics_name_tenants_on_the_operator_listener_only(upstream):
    """The series name every tenant: the client port has no /metrics, with or without a key, and
    the operator's socket serves nothing else."""
    with tenant_gateway(upstream) as gw:
        assert gw.post("/generate", json=BODY, headers=auth("acme")).status_code == 200
        for headers in ({}, auth("acme")):
            r = gw.get("/metrics", headers=headers)
            assert r.status_code == 404 and "acme" not in r.text, r.text
        operator = f"http://testserver:{OPERATOR_PORT}"
        text = gw.get(f"{operator}/metrics").text
        assert 'tenant="acme"' in text and "glm53_gateway_requests_total" in text
        assert gw.post(f"{operator}/generate", json=BODY, headers=auth("acme")).status_code == 404
        assert gw.get(f"{operator}/v1/usage", headers=auth("acme")).status_code == 404


def test_a_tenant_sees_its_own_usage_and_never_anothers(upstream):
    with tenant_gateway(upstream) as gw:
        for tenant, n in (("acme", 2), ("beta", 3)):
            for _ in range(n):
                assert gw.post("/generate", json=BODY, headers=auth(tenant)).status_code == 200
        assert gw.post("/generate?error=x", json=BODY, headers=auth("beta")).status_code == 400
        acme = gw.get("/v1/usage", headers=auth("acme")).json()
        assert acme == {
            "object": "usage",
            "tenant": "acme",
            "requests": [{"endpoint": "/generate", "status": 200, "code": None, "requests": 2}],
            "tokens": {"prompt": 6, "completion": 2, "cached": 0},  # the workers' own figures
        }
        beta = gw.get("/v1/usage", headers=auth("beta")).json()
        assert beta["tenant"] == "beta" and "acme" not in str(beta)
        assert sorted((r["status"], r["requests"]) for r in beta["requests"]) == [(200, 3), (400, 1)]
        r = gw.get("/v1/usage")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "acme" not in r.text


def test_upstream_codes_outside_the_contract_reach_clients_and_metrics_as_upstream_error(upstream):
    """The reason label takes contract codes only: an upstream's own code (here one per index, as
    a field path would be) is kept in the body as `upstream_code`, never as a series."""
    with tenant_gateway(upstream) as gw:
        for i in range(3):
            r = gw.post(f"/generate?error=invalid_messages[{i}].type", json=BODY, headers=auth("acme"))
            assert r.status_code == 400
            assert r.json()["error"] == {
                "message": f"upstream says invalid_messages[{i}].type",
                "type": "invalid_request_error",
                "param": None,
                "code": "upstream_error",
                "upstream_code": f"invalid_messages[{i}].type",
            }
        text = gw.get(f"http://testserver:{OPERATOR_PORT}/metrics").text
        assert "invalid_messages" not in text and 'reason="upstream_error"' in text


def test_the_gateway_takes_tenant_changes_without_a_restart_and_keeps_a_good_file_over_a_bad_one(upstream, tmp_path):
    from glm53_serving.gateway import app as gateway_app

    f = tmp_path / "tenants.toml"
    old = tenants.add_tenant(f, "acme")
    cfg = gateway_config(upstream, tenants=tenants.LiveTenants(f), assertion_key=KEY)
    with TestClient(build_app(cfg)) as gw:

        def status(key, within_s=3 * gateway_app.TENANTS_POLL_S, want=None):
            """The status a key gets, waiting up to `within_s` for it to become `want`."""
            deadline = time.monotonic() + within_s
            while True:
                code = gw.post("/generate", json=BODY, headers={"Authorization": f"Bearer {key}"}).status_code
                if want is None or code == want or time.monotonic() > deadline:
                    return code
                time.sleep(0.1)

        assert status(old) == 200
        new = tenants.rotate_key(f, "acme")
        assert status(new, want=200) == 200 and status(old) == 200  # both during the move
        tenants.retire_key(f, tenants.key_id(tenants.hash_key(old)))
        assert status(old, want=401) == 401 and status(new) == 200
        f.write_text("[tenants\n")
        time.sleep(2 * gateway_app.TENANTS_POLL_S)
        assert status(new) == 200  # the good file stays in force
        text = gw.get(f"http://testserver:{OPERATOR_PORT}/metrics").text
        assert 'glm53_gateway_tenants_reloads_total{result="error"} 1.0' in text
        assert 'glm53_gateway_tenants_reloads_total{result="ok"} 2.0' in text


def test_ready_means_a_generation_went_through_recently(upstream):
    """Not just the upstream's /health: a one-token probe when no client's generation went
    through lately; an upstream that cannot generate is not ready."""
    with gateway(upstream) as gw:
        r = gw.get("/ready")
        assert r.status_code == 200 and r.json() == {"ready": True}
    with gateway(f"http://127.0.0.1:{free_port()}") as gw:
        r = gw.get("/ready")
        assert r.status_code == 503 and r.json() == {"ready": False}
        assert gw.get("/health").status_code == 503

    async def no_workers(request):  # a PD router before its workers registered: healthy, cannot serve
        return JSONResponse({"error": {"message": "no workers", "code": "no_available_workers"}}, status_code=503)

    async def healthy(request):
        return JSONResponse({})

    served = serve(
        Starlette(routes=[Route("/generate", no_workers, methods=["POST"]), Route("/health", healthy, methods=["GET"])])
    )
    try:
        with gateway(next(served)) as gw:
            assert gw.get("/health").status_code == 200
            r = gw.get("/ready")
            assert r.status_code == 503 and r.json() == {"ready": False}
    finally:
        next(served, None)


def test_every_answer_carries_a_request_id_and_ends_in_one_audit_record_without_content(upstream, tmp_path):
    from glm53_serving import audit

    log = tmp_path / "audit.jsonl"
    f = tmp_path / "tenants.toml"
    key = tenants.add_tenant(f, "acme")
    cfg = gateway_config(upstream, tenants=tenants.LiveTenants(f), assertion_key=KEY, audit_log=str(log))
    secret = "the tenant's secret prompt"
    with TestClient(build_app(cfg)) as gw:
        ok, again = (
            gw.post(
                "/generate",
                json={"text": secret, "sampling_params": {"max_new_tokens": 4}},
                # SGLang's header overrides set the rid and the PD handoff fields: never a client's
                headers={
                    "Authorization": f"Bearer {key}",
                    "x-request-id": "client-42",
                    "x-override-rid": "another-tenants-rid",
                    "x-override-bootstrap-host": "2.2.2.2",
                },
            )
            for _ in range(2)
        )
        assert ok.status_code == 200 and ok.headers["x-request-id"] == "client-42"
        # The workers get a trace id: the client's id, made unique (a reused id must not collide)
        traces = [r.json()["seen"] for r in (ok, again)]
        assert [set(t) for t in traces] == [{"x-request-id"}] * 2, traces
        assert all(t["x-request-id"].startswith("client-42.") for t in traces)
        assert traces[0] != traces[1]
        with gw.stream(
            "POST", "/generate", json={**BODY, "stream": True}, headers={"Authorization": f"Bearer {key}"}
        ) as r:
            streamed_id = r.headers["x-request-id"]
            assert b"".join(r.iter_bytes()).endswith(b"[DONE]\n\n")
        bad = gw.post("/generate", json=BODY, headers={"x-request-id": "bad id\twith spaces"})
        assert bad.status_code == 401 and bad.headers["x-request-id"].startswith("g53-")
    text = log.read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["trace_id"] for r in rows[:2]] == [t["x-request-id"] for t in traces]
    rows.pop(1)
    assert [(r["request_id"], r["tenant"], r["status"], r["code"]) for r in rows] == [
        ("client-42", "acme", 200, None),  # non-streamed: the worker's usage figures too
        (streamed_id, "acme", 200, None),
        (bad.headers["x-request-id"], "-", 401, "invalid_api_key"),
    ]
    kid = tenants.key_id(tenants.hash_key(key))
    assert rows[0]["key_id"] == kid and rows[2]["key_id"] is None and all(r["latency_ms"] > 0 for r in rows)
    assert (rows[0]["prompt_tokens"], rows[0]["completion_tokens"]) == (3, 1) and "prompt_tokens" not in rows[2]
    assert secret not in text and '"text"' not in text  # no prompt, no output
    assert audit.affected(log, "2000-01-01T00:00") == {}


def test_the_affected_command_names_each_tenant_with_an_isolation_error_in_the_window(tmp_path):
    """From the gateway's answers, and from the workers' isolation events: a request whose answer
    never reached the gateway, or that never went through it, is still counted."""
    log = tmp_path / "audit.jsonl"
    keys = ("ts", "tenant", "request_id", "trace_id", "code")
    rows = [
        ("2026-12-06T01:00:00.000Z", "acme", "r1", "r1.aa", "kv_isolation_violation"),
        ("2026-12-06T02:00:00.000Z", "beta", "r2", "r2.bb", "kv_handoff_mismatch"),
        ("2026-12-06T02:30:00.000Z", "beta", "r3", "r3.cc", "context_length_exceeded"),
        ("2026-12-06T03:00:00.000Z", "gamma", "r4", "r4.dd", "kv_isolation_violation"),
        ("2026-12-06T02:10:00.000Z", "delta", "r5", "r5.ee", None),  # answered 200, aborted on a worker
        ("2026-12-06T02:11:00.000Z", "zeta", "r6", "r6.ff", None),  # its body named its own rid
    ]
    (tmp_path / "audit.jsonl.1").write_text(json.dumps(dict(zip(keys, rows[0]))) + "\n")
    log.write_text("".join(json.dumps(dict(zip(keys, r))) + "\n" for r in rows[1:]))
    worker = [
        {"ts": "2026-12-06T02:10:00.000Z", "event": "admitted", "worker": "decode-0", "rid": "r5.ee_1"},
        {"ts": "2026-12-06T02:10:01.000Z", "event": "kv_isolation_violation", "worker": "decode-0", "rid": "r5.ee_1"},
        # A worker called directly (no gateway record): the tenant its intake admitted it for
        {"ts": "2026-12-06T02:20:00.000Z", "event": "admitted", "worker": "server", "rid": "x9", "tenant": "eps"},
        {"ts": "2026-12-06T02:20:01.000Z", "event": "kv_isolation_violation", "worker": "server", "rid": "x9"},
        {"ts": "2026-12-06T05:00:00.000Z", "event": "kv_handoff_mismatch", "worker": "decode-0", "rid": "late"},
        {
            "ts": "2026-12-06T02:11:00.000Z",
            "event": "admitted",
            "worker": "server",
            "rid": "own",
            "request_id": "r6.ff",
        },
        {"ts": "2026-12-06T02:11:01.000Z", "event": "kv_isolation_violation", "worker": "server", "rid": "own"},
    ]
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "decode-0.4242.jsonl").write_text("".join(json.dumps(e) + "\n" for e in worker))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "glm53_serving.audit",
            "affected",
            "--run-dir",
            str(tmp_path),
            "--since",
            "2026-12-06T00:30",
            "--until",
            "2026-12-06T02:45",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == "acme\t1\tr1\nbeta\t1\tr2\ndelta\t1\tr5\neps\t1\tx9\nzeta\t1\tr6\n"
    assert "5 tenants affected" in out.stderr
    # Without the workers' events, only what the gateway answered
    assert set(audit.affected(log, "2026-12-06T00:30", "2026-12-06T02:45")) == {"acme", "beta"}
    shown = audit.show(log, tmp_path / "events", "r5")
    assert shown["tenant"] == "delta" and shown["workers"] == ["decode-0"]
    assert [e["event"] for e in shown["events"]] == ["admitted", "kv_isolation_violation"]
    assert audit.show(log, tmp_path / "events", "r6.ff")["workers"] == ["server"]
    assert audit.show(log, tmp_path / "events", "nobody") is None


def test_usage_comes_from_the_end_of_the_workers_answer():
    from glm53_serving.gateway.usage import usage_of

    generate_stream = (
        b'data: {"text":"a","meta_info":{"prompt_tokens":12,"completion_tokens":1,"cached_tokens":8}}\n\n'
        b'data: {"text":"\\"prompt_tokens\\": 999","meta_info":{"prompt_tokens":12,"completion_tokens":2,'
        b'"cached_tokens":8}}\n\ndata: [DONE]\n\n'
    )
    assert usage_of(generate_stream) == {"prompt": 12, "completion": 2, "cached": 8}
    chat = (
        b'{"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":0}}}'
    )
    assert usage_of(chat) == {"prompt": 30, "completion": 4, "cached": 0}
    assert usage_of(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\ndata: [DONE]\n\n') == {}


def test_a_client_that_did_not_ask_for_usage_never_sees_the_usage_event():
    """The workers end every OpenAI stream with a usage event (--stream-response-default-include-usage);
    the gateway reads it and takes it out of the streams of clients that did not ask, however the
    stream is cut into chunks."""
    from glm53_serving.gateway.usage import UsageEventFilter, hides_usage, usage_of

    chat = {"messages": [], "stream": True}
    assert hides_usage("/v1/chat/completions", chat) and hides_usage("/v1/completions", chat)
    assert hides_usage("/v1/chat/completions", {**chat, "stream_options": {"include_usage": False}})
    assert hides_usage("/v1/chat/completions", {**chat, "stream_options": {"continuous_usage_stats": True}})
    assert not hides_usage("/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    assert not hides_usage("/v1/chat/completions", {**chat, "stream": False})
    assert not hides_usage("/generate", chat)
    usage_event = (
        b'data: {"id":"a","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}\n\n'
    )
    before = (
        b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}\n\n'
        b'data: {"id":"a","choices":[{"index":0,"delta":{},"finish_reason":"length"}],"usage":null}\n\n'
    )
    events = before + usage_event + b"data: [DONE]\n\n"
    for size in (1, 3, 17, 64, len(events)):
        f, out = UsageEventFilter(), b""
        for i in range(0, len(events), size):
            out += f.feed(events[i : i + size])
        out += f.flush()
        assert out == before + b"data: [DONE]\n\n", size
    assert usage_of(events) == {"prompt": 7, "completion": 2}  # read before it is taken out
    cut = UsageEventFilter()  # an unterminated stream (the upstream failed): its bytes still reach the client
    assert cut.feed(b'data: {"id":"a"') == b"" and cut.flush() == b'data: {"id":"a"'

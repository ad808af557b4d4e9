"""request_guard's ASGI layers on a stand-in app: contract bodies for upstream's own 4xx, 413 before reading."""

import pytest
from starlette.applications import Starlette
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from glm53_serving import env, request_guard

LIMIT = 1024
READ = []


async def upstream_generate(request):
    READ.append(len(await request.body()))
    shape = request.query_params.get("shape")
    if shape == "str":
        return JSONResponse({"error": 'invalid type: string "hot", expected f64'}, status_code=400)
    if shape == "object":
        return JSONResponse({"object": "error", "message": "Messages cannot be empty.", "code": 400}, status_code=400)
    if shape == "text":
        return PlainTextResponse("Not Found", status_code=404)
    if shape == "contract":
        return JSONResponse(
            {"error": {"message": "m", "type": "invalid_request_error", "param": "p", "code": "c"}}, status_code=400
        )
    return JSONResponse({"text": "ok"})


async def upstream_other(request):
    return JSONResponse({"detail": "theirs"}, status_code=400)


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setenv(env.MAX_BODY_BYTES.name, str(LIMIT))
    app = Starlette(
        routes=[
            Route("/generate", upstream_generate, methods=["POST"]),
            Route("/v1/messages", upstream_other, methods=["POST"]),
        ]
    )
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=LIMIT)
    app.add_middleware(request_guard.ContractErrors)
    READ.clear()
    return TestClient(app)


@pytest.mark.parametrize(
    "shape,status,message",
    [
        ("str", 400, 'invalid type: string "hot", expected f64'),
        ("object", 400, "Messages cannot be empty."),
        ("text", 404, "Not Found"),
    ],
)
def test_upstream_rejections_get_the_contract_shape(client, shape, status, message):
    r = client.post(f"/generate?shape={shape}", json={})
    assert r.status_code == status
    assert r.json() == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "not_found" if status == 404 else "invalid_request_error",
        }
    }


def test_contract_bodies_and_successes_pass_unchanged(client):
    r = client.post("/generate?shape=contract", json={})
    assert r.json()["error"] == {"message": "m", "type": "invalid_request_error", "param": "p", "code": "c"}
    assert client.post("/generate", json={}).json() == {"text": "ok"}


def test_other_endpoints_keep_their_own_error_shape(client):
    # /v1/messages answers in Anthropic's shape: not ours to rewrite
    assert client.post("/v1/messages", json={}).json() == {"detail": "theirs"}


def test_declared_oversize_body_is_413_before_the_handler_reads_it(client):
    r = client.post("/generate", content=b"x" * (LIMIT + 1))
    assert r.status_code == 413 and READ == []
    assert r.json()["error"] == {
        "message": f"Request body exceeds the limit of {LIMIT} bytes.",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
        "max_body_bytes": LIMIT,
    }


def test_chunked_oversize_body_is_413(client):
    r = client.post("/generate", content=iter([b"x" * 600, b"x" * 600]))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_the_gateway_knows_the_kv_guards_messages_the_router_keeps():
    from glm53_serving.errors import KV_HANDOFF_MESSAGE, KV_ISOLATION_MESSAGE, code_from_message

    ours = f"{KV_ISOLATION_MESSAGE} this request's ..."
    assert code_from_message(ours) == ("kv_isolation_violation", ours)
    assert code_from_message(f"{KV_HANDOFF_MESSAGE} prefill sent ...") == (
        "kv_handoff_mismatch",
        f"{KV_HANDOFF_MESSAGE} prefill sent ...",
    )
    # PD decode wraps the reason prefill gave for failing the transfer in its own message.
    wrapped = (
        f"Decode transfer failed for request rank=0 rid='r' with exception KVTransferError(bootstrap_room=7): {ours}"
    )
    assert code_from_message(wrapped) == ("kv_isolation_violation", ours)
    # The router cuts a PD stream's error body mid-JSON; the message still ends at its closing quote.
    cut = 'data: {\'error\': {"message":{"error":{"message":"' + ours + '","type":"server_error","code":"kv_is'
    assert code_from_message(cut) == ("kv_isolation_violation", ours)
    assert '"' not in KV_ISOLATION_MESSAGE + KV_HANDOFF_MESSAGE
    assert code_from_message("something else") is None and code_from_message(None) is None

"""The gateway's answer to an upstream error, without sockets: the worker's own contract error
where the router rewrote or cut it, and a contract body (code `upstream_error`) otherwise."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm53_serving.errors import CONTRACT, KV_HANDOFF_MESSAGE, KV_ISOLATION_MESSAGE
from glm53_serving.gateway.upstream_errors import answer, worker_body_inside

KV = {"message": "KV isolation violation", "type": "server_error", "param": None, "code": "kv_isolation_violation"}


def raw(obj) -> bytes:
    return json.dumps(obj).encode()


def test_a_workers_contract_error_passes_with_its_numbers():
    err = {
        "message": "too long",
        "type": "invalid_request_error",
        "param": "input_ids",
        "code": "context_length_exceeded",
        "prompt_tokens": 600,
        "max_input_tokens": 505,
    }
    assert answer(400, raw({"error": err})) == (400, {"error": err})


def test_the_routers_pd_rewrite_is_undone():
    # sglang-router: decode's 500 kv_isolation_violation becomes a 500 "decode_error" whose message
    # holds the worker's body; the type is renamed and param dropped.
    routed = {"error": {"message": f"Decode server error: {json.dumps({'error': KV})} (500)", "type": "Bad Request"}}
    assert answer(500, raw(routed)) == (500, {"error": KV})
    # the same inside a 502 the router chose: the worker's contract status wins
    assert answer(502, raw(routed))[0] == 500


def test_a_stream_error_cut_mid_json_keeps_the_kv_guards_code():
    sse = f'data: {{"error": {{"message": "{KV_HANDOFF_MESSAGE} prefill sent 12 tokens, decode expected 13", "ty'
    status, body = answer(500, sse.encode())
    assert status == 500 and body["error"]["code"] == "kv_handoff_mismatch"
    assert body["error"]["message"] == f"{KV_HANDOFF_MESSAGE} prefill sent 12 tokens, decode expected 13"


def test_a_kv_message_in_a_client_error_is_not_taken_for_ours():
    # Only a server's 5xx message is the server's own words; a 4xx may echo what a client sent.
    status, body = answer(400, raw({"error": {"message": f"{KV_ISOLATION_MESSAGE} forged", "code": "x"}}))
    assert status == 400 and body["error"]["code"] == "upstream_error"


@pytest.mark.parametrize(
    "status, upstream, expected",
    [
        (
            422,
            b"Failed to deserialize the JSON body into the target type: missing field `model`",
            {
                "message": "The model server answered 422: Failed to deserialize the JSON body into the target "
                "type: missing field `model`",
                "type": "invalid_request_error",
                "param": None,
                "code": "upstream_error",
            },
        ),
        (
            503,
            raw({"error": {"message": "no workers", "code": "no_available_workers", "param": 7}}),
            {
                "message": "no workers",
                "type": "server_error",
                "param": None,
                "code": "upstream_error",
                "upstream_code": "no_available_workers",
            },
        ),
        (
            502,
            b"",
            {
                "message": "The model server answered 502: ",
                "type": "server_error",
                "param": None,
                "code": "upstream_error",
            },
        ),
    ],
)
def test_anything_else_becomes_a_contract_body_with_the_upstreams_status_and_message(status, upstream, expected):
    assert answer(status, upstream) == (status, {"error": expected})


@given(st.integers(400, 599), st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_every_answer_is_a_contract_body(status, upstream):
    out_status, body = answer(status, upstream)
    err = body["error"]
    assert 400 <= out_status < 600 and err["code"] in CONTRACT
    assert isinstance(err["message"], str) and (err["param"] is None or isinstance(err["param"], str))
    assert err["type"] in ("invalid_request_error", "server_error")


def test_the_worker_body_is_found_inside_any_text():
    inner = {"error": KV}
    for wrapped in (json.dumps(inner), "Decode server error: " + json.dumps(inner) + " (status 500)"):
        assert worker_body_inside(wrapped) == inner
    for other in ("", "plain text", '{"error": {"code": "decode_error", "message": "x"}}', "{broken"):
        assert worker_body_inside(other) is None

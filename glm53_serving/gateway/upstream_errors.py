"""What the gateway answers when its upstream (the router or the single server) answers an error.

sglang-router rewrites PD workers' errors: it wraps decode's body in a message of its own (a 500
`kv_isolation_violation` arrives as a 500 `decode_error` whose message holds the worker's JSON),
renames the type ("Bad Request"), drops `param`, and on a stream cuts the body mid-JSON inside an
SSE line. The client must get the worker's own contract error where it is still there, and a
contract body with the upstream's message otherwise. Pure functions of (status, body bytes):
tests/unit/test_upstream_errors.py holds them without sockets.
"""

from __future__ import annotations

import json

from glm53_serving.errors import CONTRACT, code_from_message, contract, error_body, status_type

_KEYS = ("message", "type", "param", "code")


def answer(status: int, raw: bytes) -> tuple[int, dict]:
    """(status, body) for the client: every code in it is a contract code."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and "message" in err:
        message = str(err["message"])
        restored = worker_error(status, message)
        if restored is not None:
            return restored
        code = err.get("code")
        extra = {k: v for k, v in err.items() if k not in _KEYS}
        param = err.get("param") if isinstance(err.get("param"), str) else None
        if code in CONTRACT:  # a worker's own error, passed as it came (the status is the upstream's)
            return status, error_body(code, message, param, status_type(status), **extra)
        if isinstance(code, str):
            extra["upstream_code"] = code
        return status, error_body("upstream_error", message, param, status_type(status), **extra)
    # Not an OpenAI error: the router's PD stream error (an SSE line wrapping the worker's body in
    # a Python repr, sometimes cut mid-JSON), or a text/plain answer.
    text = raw.decode(errors="replace")
    restored = worker_error(status, text)
    if restored is not None:
        return restored
    return status, error_body(
        "upstream_error", f"The model server answered {status}: {text[:500]}", type_=status_type(status)
    )


def worker_error(status: int, text: str) -> tuple[int, dict] | None:
    """The worker's own contract error inside a router-rewritten error text, with its contract
    status; or, for a 5xx whose body the router cut or reduced to a message, a KV guard's message."""
    inner = worker_body_inside(text)
    if inner is not None:
        return contract(inner["error"]["code"])[0], inner
    kv = code_from_message(text) if status >= 500 else None
    if kv is None:
        return None
    code, message = kv
    return contract(code)[0], error_body(code, message)


def worker_body_inside(message: str) -> dict | None:
    """A worker's contract error body embedded in a text (the first JSON object in it whose
    `error.code` is a contract code), or None."""
    decoder = json.JSONDecoder()
    start = message.find("{")
    while start != -1:
        try:
            inner, _ = decoder.raw_decode(message, start)
        except json.JSONDecodeError:
            inner = None
        err = inner.get("error") if isinstance(inner, dict) else None
        if isinstance(err, dict) and err.get("code") in CONTRACT and isinstance(err.get("message"), str):
            return {"error": err}
        start = message.find("{", start + 1)
    return None

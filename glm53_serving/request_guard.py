"""Request validation at every server's HTTP front door, and 4xx bodies in the contract shape.

Invariants, in each SGLang server's HTTP process (single, prefill and decode alike):
- a body over the configured size (`GLM53_MAX_BODY_BYTES`, set by the launcher from the
  topology) is a 413 before it is read: a Content-Length over the limit is refused before the
  first byte, a chunked body as soon as the count passes it (Starlette's RequestBodyLimitMiddleware);
- a generation request (validation.GENERATION) reaches SGLang's handler only after
  `validation.check_request` passed, so a malformed one never reaches a tokenizer or scheduler;
- every 4xx on a generation endpoint, and every 413, has the contract body (errors.py), whoever
  produced it: upstream answers its own rejections in four shapes, some a plain-text body.

Where each layer sits in the worker's middleware stack: front_door.py (declared once).
"""

from __future__ import annotations

import logging

import orjson

from glm53_serving import env, rejection, validation
from glm53_serving.errors import ClientError

logger = logging.getLogger("glm53_serving")


def max_body_bytes() -> int:
    raw = env.MAX_BODY_BYTES.get()
    if not (raw or "").isdigit() or int(raw) <= 0:
        raise ValueError(f"{env.MAX_BODY_BYTES.name}={raw!r}: a positive number of bytes")
    return int(raw)


_prepared: validation.RequestChecks | None = None


def prepare(tokenizer_manager) -> validation.RequestChecks:
    """This server's checks, built from its tokenizer manager and warmed (the front door calls it
    before the server reports ready: built lazily, the first requests took 2 to 7 s)."""
    global _prepared
    if _prepared is None:
        tm = tokenizer_manager
        _prepared = validation.RequestChecks(
            tm.model_config.vocab_size,
            not tm.model_config.is_multimodal,
            validation.sglang_verify(tm.tokenizer, tm.sampling_params_class),
            max_n=validation.MAX_N_PD if env.role() != "single" else validation.MAX_N,
        ).warmed()
    return _prepared


class RequestValidator:
    """Reads a generation request's body, validates it, and replays it to SGLang's handler."""

    def __init__(self, app, checks: validation.RequestChecks | None = None):
        self.app = app
        self._checks = checks  # else this server's (prepare)

    def checks(self) -> validation.RequestChecks:
        if self._checks is None and _prepared is None:
            from sglang.srt.entrypoints.http_server import get_global_state

            prepare(get_global_state().tokenizer_manager)
        if self._checks is None:
            self._checks = _prepared
        return self._checks

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT") or path not in validation.GENERATION:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()  # RequestBodyLimitMiddleware raises here past the limit
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        try:
            content_type = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-type"), None)
            body = validation.parse_body(raw, content_type)
            self.checks().check(path, body)
        except ClientError as e:
            rejection.count(e, path, detail=f"invalid {e.param or 'body'}")
            return await rejection.send_error(send, e)

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()  # after the body: the client's disconnect, for streaming aborts

        await self.app(scope, replay, send)


class ContractErrors:
    """Rewrites a non-contract 4xx body (generation endpoints) or 413 (anywhere) into the contract shape."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        generation = scope.get("path", "") in validation.GENERATION
        held: dict | None = None
        chunks: list[bytes] = []

        async def guarded_send(message):
            nonlocal held
            if message["type"] == "http.response.start":
                status = message["status"]
                if 400 <= status < 500 and (generation or status == 413):
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                status, raw = held["status"], b"".join(chunks)
                held = None
                if _is_contract(raw):
                    await send(
                        {
                            "type": "http.response.start",
                            "status": status,
                            "headers": [
                                (b"content-type", b"application/json"),
                                (b"content-length", str(len(raw)).encode()),
                            ],
                        }
                    )
                    return await send({"type": "http.response.body", "body": raw, "more_body": False})
                return await rejection.send_json(send, status, contract_body(status, raw))
            await send(message)

        await self.app(scope, receive, guarded_send)


def _is_contract(raw: bytes) -> bool:
    try:
        err = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= err.keys()


def contract_body(status: int, raw: bytes) -> dict:
    """The contract body for an upstream 4xx: its message, whatever shape upstream gave it."""
    if status == 413:
        return ClientError(
            "request_too_large",
            f"Request body exceeds the limit of {max_body_bytes()} bytes.",
            details={"max_body_bytes": max_body_bytes()},
        ).body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = raw.decode("utf-8", errors="replace")
    message = body
    if isinstance(body, dict):
        err = body.get("error")
        message = (
            (err.get("message") if isinstance(err, dict) else err) or body.get("message") or body.get("detail") or body
        )
    code = "not_found" if status == 404 else "invalid_request_error"
    return ClientError(code, str(message)[:2000]).body()

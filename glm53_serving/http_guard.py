"""Hard 4xx: a request we reject gets its 4xx status and our JSON body before any byte of a 200.

Invariant: if a guard rejected the request (`reject()`), the client receives exactly one response,
with the contract's status and body, whatever SGLang's handler had started to send.

Attack/incident closed: upstream answers an over-length streaming /generate with HTTP 200 and
the error inside the stream, and a scheduler-side rejection of a streaming chat the same way; a
client (or a proxy, or the incident's clients) that trusts the status takes it for an answer.

How: a pure ASGI middleware on SGLang's app holds back `http.response.start` until the first
body chunk exists. Guards running anywhere in the request's task tree (the tokenizer hook, in
the same asyncio context) record their rejection in a per-request slot; when the first chunk
arrives and a rejection is recorded, the held-back start and the upstream body are dropped and
the contract response is sent instead. Holding the start costs nothing a client can see: no
status is useful before the first byte of the body exists.
"""

from __future__ import annotations

import contextvars
import json
import logging
from dataclasses import dataclass

from glm53_serving.errors import ClientError, code_from_message
from glm53_serving.metrics import LazyCounter

logger = logging.getLogger("glm53_serving")


@dataclass(slots=True)
class _Slot:
    path: str
    rejection: ClientError | None = None


_slot: contextvars.ContextVar[_Slot | None] = contextvars.ContextVar("glm53_request_slot", default=None)
REJECTIONS = LazyCounter("glm53_rejections", "Requests rejected by glm53_serving guards", ("reason", "endpoint"))


def reject(error: ClientError, reason: str) -> None:
    """Record that this request is rejected; the middleware turns it into the response."""
    slot = _slot.get()
    endpoint = slot.path if slot else "unknown"
    if slot is not None and slot.rejection is None:
        slot.rejection = error
    logger.info("glm53_serving rejected %s on %s: %s", reason, endpoint, error.message)
    REJECTIONS.inc(reason=reason, endpoint=endpoint)


async def send_json(send, status: int, body: dict) -> None:
    """One complete JSON response (every response our middlewares answer themselves)."""
    raw = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": raw, "more_body": False})


def current_path() -> str | None:
    slot = _slot.get()
    return slot.path if slot else None


class HardRejectMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        slot = _Slot(path=scope.get("path", ""))
        token = _slot.set(slot)
        held: dict | None = None
        replaced = False

        async def guarded_send(message):
            nonlocal held, replaced
            if replaced:
                return  # the contract response went out; swallow the rest of upstream's
            if message["type"] == "http.response.start":
                held = message
                return
            if message["type"] == "http.response.body" and held is not None:
                if slot.rejection is not None:
                    replaced = True
                    return await send_json(send, slot.rejection.status, slot.rejection.body())
                start, held = held, None
                await send(start)
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        finally:
            _slot.reset(token)


# FINISH_ABORT.err_type values our scheduler-side guards set -> contract code (errors.py)
_KV_ABORTS = {"kv_isolation_violation": "kv_isolation_violation", "kv_handoff_mismatch": "kv_handoff_mismatch"}


def contract_abort_hook(self, out, state, is_stream, *args, **kwargs):
    """BEFORE TokenizerManager._handle_abort_finish_reason (HTTP process, in the request's own
    context): a scheduler abort by a KV guard becomes the contract response. Upstream would send
    its own 500 body, or an error inside a 200 stream; the middleware sends ours instead, before
    any byte of the upstream response (nothing of the request's output reaches the client)."""
    reason = (out.get("meta_info") or {}).get("finish_reason") or {}
    if reason.get("type") != "abort":
        return None
    code, message = _KV_ABORTS.get(reason.get("err_type")), reason.get("message")
    if code is None and reason.get("status_code") == 500:
        # PD decode: prefill failed the transfer for a KV guard's reason (kv_owner._tell_decode),
        # and upstream's abort wraps that reason in its own message.
        code, message = code_from_message(message) or (None, message)
    if code is not None:
        reject(ClientError(code, message or code, details={"rid": getattr(state.obj, "rid", None)}), reason=code)
    return None


def install_middleware_hook(*args, **kwargs):
    """BEFORE http_server.launch_server: add the middlewares while the app can still take them
    (the tenant guard inside, so that its 401/403 are counted with the slot in place)."""
    from sglang.srt.entrypoints.http_server import app

    from glm53_serving import tenant_guard

    tenant_guard.install(app, kwargs.get("server_args", args[0] if args else None))
    if not any(m.cls is HardRejectMiddleware for m in app.user_middleware):
        app.add_middleware(HardRejectMiddleware)
    return None


def installed() -> bool:
    from sglang.srt.entrypoints.http_server import app

    from glm53_serving import tenant_guard

    return any(m.cls is HardRejectMiddleware for m in app.user_middleware) and tenant_guard.installed(app)

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

from glm53_serving import rejection
from glm53_serving.errors import ClientError, code_from_message


class HardRejectMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        slot, token = rejection.open_slot(scope.get("path", ""), rejection.request_id_of(scope))
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
                    return await rejection.send_error(send, slot.rejection)
                start, held = held, None
                await send(start)
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        finally:
            rejection.close_slot(token)


# FINISH_ABORT.err_type values our scheduler-side guards set -> contract code (errors.py)
_SCHEDULER_ABORTS = {
    "kv_isolation_violation": "kv_isolation_violation",
    "kv_handoff_mismatch": "kv_handoff_mismatch",
    # a session turn longer than the deployment serves (admission.session_turn_hook)
    "context_length_exceeded": "context_length_exceeded",
    "max_tokens_exceeded": "max_tokens_exceeded",
}


def contract_abort_hook(self, out, state, is_stream, *args, **kwargs):
    """BEFORE TokenizerManager._handle_abort_finish_reason (HTTP process, in the request's own
    context): a scheduler abort by a KV guard becomes the contract response. Upstream would send
    its own 500 body, or an error inside a 200 stream; the middleware sends ours instead, before
    any byte of the upstream response (nothing of the request's output reaches the client)."""
    reason = (out.get("meta_info") or {}).get("finish_reason") or {}
    if reason.get("type") != "abort":
        return None
    code, message = _SCHEDULER_ABORTS.get(reason.get("err_type")), reason.get("message")
    if code is None and reason.get("status_code") == 500:
        # PD decode: prefill failed the transfer for a KV guard's reason (kv_owner._tell_decode),
        # and upstream's abort wraps that reason in its own message.
        code, message = code_from_message(message) or (None, message)
    if code is not None:
        rejection.reject(ClientError(code, message or code, details={"rid": getattr(state.obj, "rid", None)}))
    return None

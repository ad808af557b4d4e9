"""Ground floor of every worker guard: the request's slot, recording a rejection, sending one.

Every guard that refuses a request (the tenant guard, validation, intake, the session hooks)
records it here; the hard-4xx middleware (http_guard.py) turns a recorded rejection into the
response, before any byte of a 200. This module imports no guard, so every guard can import it.

Metrics: `glm53_rejections{reason, endpoint}` with bounded labels only: `reason` is a contract
code (errors.CONTRACT) and `endpoint` a route SGLang serves or "other". Never a field path
(`messages[123].content[0].type` made one series per index) or a client-chosen URL; the full
reason is in the log line.
"""

from __future__ import annotations

import contextvars
import json
import logging
from dataclasses import dataclass

from glm53_serving import events, request_ids
from glm53_serving.errors import CONTRACT, ClientError
from glm53_serving.metrics import LazyCounter

logger = logging.getLogger("glm53_serving")


@dataclass(slots=True)
class Slot:
    """One HTTP request's state, shared by every guard in its task tree (contextvars)."""

    path: str
    request_id: str | None = None  # the x-request-id it came with (request_ids.py), if sane
    rejection: ClientError | None = None


_slot: contextvars.ContextVar[Slot | None] = contextvars.ContextVar("glm53_request_slot", default=None)
REJECTIONS = LazyCounter("glm53_rejections", "Requests rejected by glm53_serving guards", ("reason", "endpoint"))
_KNOWN_ENDPOINTS: frozenset[str] = frozenset()  # set by the front door from the app's routes


def open_slot(path: str, request_id: str | None = None) -> tuple[Slot, contextvars.Token]:
    slot = Slot(path, request_id)
    return slot, _slot.set(slot)


def close_slot(token: contextvars.Token) -> None:
    _slot.reset(token)


def current_slot() -> Slot | None:
    return _slot.get()


def current_path() -> str | None:
    slot = _slot.get()
    return slot.path if slot else None


def request_id_of(scope) -> str | None:
    """The request's `x-request-id` (request_ids.py), where it is a sane token."""
    for name, value in scope.get("headers", ()):
        if name == _REQUEST_ID:
            return request_ids.sane(value.decode("latin-1"))
    return None


_REQUEST_ID = request_ids.HEADER.encode()


def current_request_id() -> str | None:
    slot = _slot.get()
    return slot.request_id if slot else None


def know_endpoints(paths) -> None:
    global _KNOWN_ENDPOINTS
    _KNOWN_ENDPOINTS = frozenset(paths)


def endpoint_label(path: str | None) -> str:
    return path if path in _KNOWN_ENDPOINTS else "other"


def count(error: ClientError, path: str | None, detail: str | None = None, request_id: str | None = None) -> None:
    """Log, count and record a rejection (bounded labels; `detail` goes to the log only). The
    request id is the slot's, or `request_id` where no slot is open yet (authentication)."""
    request_id = request_id or current_request_id()
    logger.info("glm53_serving rejected %s on %s [%s]: %s", detail or error.code, path, request_id, error.message)
    REJECTIONS.inc(reason=error.code if error.code in CONTRACT else "other", endpoint=endpoint_label(path))
    events.record("rejected", rid=None, request_id=request_id, code=error.code, endpoint=endpoint_label(path))


def reject(error: ClientError, detail: str | None = None) -> None:
    """Record that this request is rejected; the hard-4xx middleware turns it into the response."""
    slot = _slot.get()
    if slot is not None and slot.rejection is None:
        slot.rejection = error
    count(error, slot.path if slot else None, detail)


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


async def send_error(send, error: ClientError) -> None:
    await send_json(send, error.status, error.body())

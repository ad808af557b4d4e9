"""Request ids: one id follows a request from the gateway through the router to every worker.

The gateway answers every request with `x-request-id` (the client's, when it is a sane token,
else a new one) and forwards a *trace id* to the router in the same header. sglang-router
(0.3.2, measured) forwards `x-request-id` to prefill and decode on /generate, /v1/completions and
/v1/chat/completions, streaming or not, while it drops the body's `rid` on chat requests and
every other custom header. The workers take the trace id as the request's SGLang `rid` where
the body names none (tenant_guard.take_request_id), so it is in SGLang's own logs, in ours, in
the worker event logs (events.py) and in the answer's `id`.

The trace id is the client's id plus a random suffix: SGLang refuses a `rid` it already serves
("Duplicate request ID"), so a client that reuses an id, or a tenant that guesses another's,
must not collide with a request in flight. Ground floor: imports nothing of the package.
"""

from __future__ import annotations

import re
import secrets

HEADER = "x-request-id"
_SANE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def sane(value: str | None) -> str | None:
    """`value` when it is a token fit for logs and headers, else None."""
    return value if value is not None and _SANE.fullmatch(value) else None


def new() -> str:
    return "g53-" + secrets.token_hex(12)


def trace_id(request_id: str) -> str:
    """The id the workers serve the request under: unique even where `request_id` is not."""
    return f"{request_id[:110]}.{secrets.token_hex(6)}"

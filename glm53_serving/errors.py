"""The error contract: every rejection a client can cause, its HTTP status and its JSON body.

Bodies follow OpenAI's shape so that every OpenAI client library surfaces them:
    {"error": {"message": str, "type": str, "param": str | None, "code": str, ...numbers}}
The gateway, the worker plugin and the tests all build and read errors through this module;
docs/errors.md lists the same codes (tests/unit/test_errors.py holds them equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# code -> (HTTP status, OpenAI error type)
CONTRACT: dict[str, tuple[int, str]] = {
    "context_length_exceeded": (400, "invalid_request_error"),
    "max_tokens_exceeded": (400, "invalid_request_error"),
    "invalid_request_error": (400, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
    "invalid_api_key": (401, "invalid_request_error"),
    "permission_denied": (403, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "rate_limit_exceeded": (429, "rate_limit_error"),
    "internal_error": (500, "server_error"),
    "kv_isolation_violation": (500, "server_error"),
    "kv_handoff_mismatch": (500, "server_error"),
    # the gateway's answers about its upstream (the router or the single server)
    "upstream_error": (502, "server_error"),  # or the upstream's own status: see status_type()
    "upstream_unavailable": (502, "server_error"),
    "upstream_timeout": (504, "server_error"),
}


def contract(code: str) -> tuple[int, str]:
    """(status, type) of a contract code; a code outside the contract is a bug of ours, refused
    even under python -O."""
    try:
        return CONTRACT[code]
    except KeyError:
        raise TypeError(f"{code!r} is not a code of the error contract (errors.CONTRACT)") from None


def status_type(status: int) -> str:
    """The OpenAI error type of a status the upstream chose (an `upstream_error` keeps its status)."""
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(code: str, message: str, param: str | None = None, type_: str | None = None, **details: Any) -> dict:
    """The one builder of an error body: `code` must be a contract code."""
    return {"error": {"message": message, "type": type_ or contract(code)[1], "param": param, "code": code, **details}}


# The scheduler-side KV guards' messages begin with these. sglang-router's PD error rewrite keeps
# only a worker's message (code "decode_internal_error"), so the gateway restores the code from it.
KV_ISOLATION_MESSAGE = "KV isolation violation:"
KV_HANDOFF_MESSAGE = "PD handoff mismatch:"
_CODE_BY_PREFIX = {KV_ISOLATION_MESSAGE: "kv_isolation_violation", KV_HANDOFF_MESSAGE: "kv_handoff_mismatch"}


def code_from_message(message) -> tuple[str, str] | None:
    """(code, our message) when a server's 5xx message carries a KV guard's message: at its start,
    or inside the message of an upstream abort that wraps it (PD decode reports a transfer that
    prefill failed as "Decode transfer failed ... KVTransferError(...): <prefill's reason>").
    Callers only ask for server errors (5xx), whose messages the server wrote."""
    if not isinstance(message, str):
        return None
    for prefix, code in _CODE_BY_PREFIX.items():
        at = message.find(prefix)
        if at != -1:
            # Our messages hold no double quote: inside a JSON text (the router cuts a PD stream's
            # error body mid-JSON) the first one ends it.
            return code, message[at:].split('"', 1)[0]
    return None


@dataclass
class ClientError(ValueError):
    """A rejection with a contract code. A ValueError, so SGLang's own handlers treat it as a
    client error (never a 500) even where our response rewrite does not reach."""

    code: str
    message: str
    param: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        contract(self.code)  # refuses a code outside the contract
        ValueError.__init__(self, self.message)

    def __str__(self) -> str:
        return self.message

    @property
    def status(self) -> int:
        return CONTRACT[self.code][0]

    def body(self) -> dict:
        return error_body(self.code, self.message, self.param, **self.details)

"""Admission: one length limit per deployment, enforced before anything is scheduled.

Invariant: a request reaches a scheduler only if every role that will hold it (the single
server, or prefill *and* decode) can serve it completely: prompt_tokens < max_input_tokens and,
when it asks for a number of output tokens, prompt_tokens + max_new_tokens <= max_total_tokens.
Everything else is a 400 `context_length_exceeded` from the HTTP/tokenizer process.

Attack/incident closed: in PD, a prompt one role accepts and the other rejects was parked
(client hangs) or, in the incident, forwarded as a one-token stub so that decode read stale KV.
With one limit computed the same way everywhere, no role ever starts on what another rejects.

Formula (per server s, from its own scheduler; docs/admission.md):
    input_s = min(context_length - 1, kv_s - 1) - 5       # SGLang's max_req_input_len (exclusive)
    decode:  input_s = min(input_s, kv_s - reserve_s)     # decode keeps num_reserved_decode_tokens free
    total_s = min(context_length, kv_s) - 2 * page_s      # single/decode hold prompt + output; prefill: no bound
    single/decode: input_s = min(input_s, total_s)        # a served prompt has room for one output token
    deployment: max_input_tokens = min_s input_s, max_total_tokens = min_s total_s
What the deployment advertises is exactly that: the largest prompt (`max_input_tokens - 1`) and
the largest prompt + output (`max_model_len`, = max_total_tokens), both served.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from glm53_serving import env
from glm53_serving.errors import ClientError

logger = logging.getLogger("glm53_serving")

NO_TOTAL_BOUND = 1 << 62


@dataclass(frozen=True, slots=True)
class Capacity:
    """What one server can hold, as its scheduler reports it."""

    role: str  # "single" | "prefill" | "decode"
    context_length: int
    kv_tokens: int
    page_size: int = 1
    decode_reserve: int = 0

    def __post_init__(self):
        if self.role not in ("single", "prefill", "decode"):
            raise ValueError(f"role must be single, prefill or decode, not {self.role!r}")
        if min(self.context_length, self.kv_tokens, self.page_size) <= 0 or self.decode_reserve < 0:
            raise ValueError(f"context_length, kv_tokens and page_size must be positive, decode_reserve >= 0: {self}")

    @property
    def max_input_tokens(self) -> int:
        limit = min(self.context_length - 1, self.kv_tokens - 1) - 5
        if self.role == "decode":
            limit = min(limit, self.kv_tokens - self.decode_reserve)
        # A prompt the role holds must leave room for one output token: with 64-token pages the
        # total bound is below SGLang's input bound, and a prompt between the two was admitted with
        # no output to give (clip mode handed it a negative max_new_tokens).
        return min(limit, self.max_total_tokens)

    @property
    def max_total_tokens(self) -> int:
        if self.role == "prefill":  # prefill frees the prompt's KV once it is sent
            return NO_TOTAL_BOUND
        return min(self.context_length, self.kv_tokens) - 2 * self.page_size


@dataclass(frozen=True, slots=True)
class Limits:
    max_input_tokens: int  # exclusive: prompt_tokens must be < this
    max_total_tokens: int  # inclusive: prompt_tokens + max_new_tokens must be <= this
    context_length: int
    max_output_tokens: int | None = None  # inclusive: max_new_tokens must be <= this (None: the window's)

    def __post_init__(self):
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be positive: {self}")
        if self.max_input_tokens <= 1:
            raise ValueError(f"no prompt fits these limits: {self}")
        if self.max_input_tokens > self.max_total_tokens:
            raise ValueError(f"a prompt of max_input_tokens - 1 must leave room for one output token: {self}")

    @property
    def max_prompt_tokens(self) -> int:
        """The largest prompt served (what /v1/models advertises as max_input_tokens)."""
        return self.max_input_tokens - 1

    @property
    def max_model_len(self) -> int:
        """The largest prompt + output served (what /v1/models advertises as max_model_len)."""
        return min(self.max_total_tokens, self.context_length)

    @classmethod
    def of(cls, capacities: Iterable[Capacity], max_output_tokens: int | None = None) -> Limits:
        caps = list(capacities)
        if not caps:
            raise ValueError("a deployment needs at least one role")
        return cls(
            max_input_tokens=min(c.max_input_tokens for c in caps),
            max_total_tokens=min(c.max_total_tokens for c in caps),
            context_length=min(c.context_length for c in caps),
            max_output_tokens=max_output_tokens,
        )

    def within(self, other: Limits) -> bool:
        return self.max_input_tokens <= other.max_input_tokens and self.max_total_tokens <= other.max_total_tokens

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls) -> Limits | None:
        raw = env.DEPLOYMENT_LIMITS.get()
        return cls(**json.loads(raw)) if raw else None


def clip_output() -> bool:
    """The deployment clips max_new_tokens to the budget instead of answering 400."""
    return env.CLIP_OUTPUT.get() == "1"


def check(
    limits: Limits, prompt_tokens: int, max_new_tokens: int | None, clip: bool = False, prompt_param: str = "prompt"
) -> int | None:
    """The admission decision. Returns the max_new_tokens to use (unchanged, or clipped when
    `clip`), or raises ClientError(context_length_exceeded) naming the field the client sent the
    prompt in (`prompt_param`: messages, prompt, text or input_ids) or `max_tokens`.
    `max_new_tokens` None (as much as fits) is admitted exactly when 1 is: every admitted prompt
    has room for one output token. It becomes what the deployment serves, max_total_tokens -
    prompt_tokens (or the output limit, if less): SGLang alone generates to the context window,
    past max_model_len where pages leave slack (64-token pages: 128 tokens past it, found by the
    isolation suite). More than the output limit is max_tokens_exceeded (clipped to it when
    `clip`)."""
    details = {
        "prompt_tokens": prompt_tokens,
        "max_new_tokens": max_new_tokens,
        "max_input_tokens": limits.max_input_tokens,
        "max_total_tokens": limits.max_total_tokens,
    }
    cap = limits.max_output_tokens
    if cap is not None:
        details["max_output_tokens"] = cap
    if prompt_tokens >= limits.max_input_tokens:
        raise ClientError(
            "context_length_exceeded",
            f"This deployment accepts prompts of at most {limits.max_input_tokens - 1} tokens; "
            f"the prompt has {prompt_tokens}.",
            param=prompt_param,
            details=details,
        )
    if max_new_tokens is None:
        fits = limits.max_total_tokens - prompt_tokens
        return fits if cap is None else min(cap, fits)
    if cap is not None and max_new_tokens > cap:
        if not clip:
            raise ClientError(
                "max_tokens_exceeded",
                f"This model generates at most {cap} output tokens per request; {max_new_tokens} were requested.",
                param="max_tokens",
                details=details,
            )
        max_new_tokens = cap
    if max_new_tokens is not None and prompt_tokens + max_new_tokens > limits.max_total_tokens:
        if clip:
            return limits.max_total_tokens - prompt_tokens
        raise ClientError(
            "context_length_exceeded",
            f"This deployment serves at most {limits.max_total_tokens} tokens per request (prompt + output); "
            f"{prompt_tokens} prompt tokens + {max_new_tokens} requested output tokens exceed it.",
            param="max_tokens",
            details=details,
        )
    return max_new_tokens


# --- state of the HTTP process (set by startup.py, read by intake.py) --------------------------

_limits: Limits | None = None  # set in the HTTP process once the schedulers reported


def set_limits(limits: Limits) -> None:
    global _limits
    _limits = limits
    logger.info("glm53_serving admission limits: %s", limits)


def current_limits() -> Limits | None:
    return _limits


# --- session turns, in the scheduler -----------------------------------------------------------


def session_turn_hook(original, self, req, *args, **kwargs):
    """AROUND Session.create_req (scheduler): a session turn's prompt is the session's history
    (earlier prompts and outputs) plus what the client sent, and the HTTP process checked only
    the latter. Found by the isolation suite: a 150-token turn after 220 tokens of history, asking
    for 40, was served 410 tokens where the deployment advertises 384. The whole turn is admitted
    here by the same formula; one that does not fit ends 400 `context_length_exceeded` (as its
    first and only output, so before any byte of a 200) and leaves the session as it was."""
    new_req = original(self, req, *args, **kwargs)
    if new_req.finished_reason is not None or getattr(new_req, "to_finish", None) is not None:
        return new_req  # upstream refused it already (unknown rid, unfinished parent, ...)
    limits = _limits
    params = new_req.sampling_params
    try:
        if limits is None:  # set at start-up (startup.py); fail closed anyway
            raise ClientError("internal_error", "This server's admission limits are not set; it refuses every request.")
        params.max_new_tokens = check(
            limits, len(new_req.origin_input_ids), params.max_new_tokens, clip_output(), prompt_param="input_ids"
        )
        return new_req
    except ClientError as e:
        _forget_turn(self, new_req)
        new_req.set_finish_with_abort(e.message, status_code=e.status, err_type=e.code)
        return new_req


def _forget_turn(session, req) -> None:
    """Undo what create_req recorded for a turn it accepted: the turn is refused, not part of
    the conversation (a later turn cannot continue from it)."""
    if session.streaming:
        session._inflight = False
        return
    node = session.req_nodes.pop(req.rid, None)
    if node is not None and node.parent is not None and node in node.parent.children:
        node.parent.children.remove(node)

"""Workloads: what the tenants send at once (one interleaving), drawn by Hypothesis."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

from hypothesis import strategies as st

# Ordinary prompt tokens; the top of the 512-token tiny vocabulary is kept for tenant markers.
TOKENS = (5, 470)
MARKER_BASE, MARKER_LEN = 480, 3
DISCONNECTS = (None, "before_first", "mid")
FIRST_TURN = 4  # output tokens of a session's first turn


@dataclass(frozen=True, slots=True)
class Served:
    """What the deployment says it serves (its /v1/models) and its page size."""

    max_prompt: int  # the largest prompt served
    max_model_len: int  # the largest prompt + output served
    max_output: int | None
    page: int


@dataclass(frozen=True, slots=True)
class Call:
    tenant: str
    prompt: tuple[int, ...]
    max_new: int | None
    stream: bool
    disconnect: str | None = None  # the client leaves: before its first token, or mid-stream
    incident: bool = False  # --reintroduce-incident: the harness gives it another tenant's live slot
    abort: bool = False  # its client aborts it through the API (/abort_request, its rid) at its first token
    # A session continuation (single topology): `prompt` opens a session as turn 1, answered with
    # FIRST_TURN tokens; `then` is turn 2's input, which continues turn 1, and everything above
    # (max_new, stream, disconnect, abort) is turn 2's. Its prompt is prompt + turn 1's output + then.
    then: tuple[int, ...] = ()

    def __post_init__(self):
        if self.disconnect not in DISCONNECTS or (self.disconnect and not self.stream):
            raise ValueError(f"not a call: {self}")
        if self.abort and (not self.stream or self.disconnect):
            raise ValueError(f"an aborted call is streamed and read to its end: {self}")
        if self.then and self.incident:
            raise ValueError(f"the incident's call is one turn: {self}")

    def first_turn(self) -> Call:
        return Call(self.tenant, self.prompt, FIRST_TURN, False)

    def continued(self, first_output: list[int]) -> Call:
        """What turn 2 is as one call: the session's history and its own input as the prompt."""
        prompt = (*self.prompt, *first_output, *self.then)
        return Call(self.tenant, prompt, self.max_new, self.stream, self.disconnect, abort=self.abort)

    @property
    def solo_key(self) -> tuple:
        """What its greedy output depends on: the prompt and the output length, not the tenant."""
        return (self.prompt, self.max_new)


def marker(tenants: list[str], tenant: str) -> tuple[int, ...]:
    """The tenant's own token sequence, in every prompt it sends and in no other tenant's."""
    i = tenants.index(tenant)
    return tuple(MARKER_BASE + MARKER_LEN * i + k for k in range(MARKER_LEN))


def to_json(calls: list[Call], tenants: list[str]) -> str:
    return json.dumps({"tenants": tenants, "calls": [asdict(c) for c in calls]})


def from_json(text: str) -> tuple[list[Call], list[str]]:
    raw = json.loads(text)
    return [Call(**{**c, "prompt": tuple(c["prompt"]), "then": tuple(c.get("then", ()))}) for c in raw["calls"]], raw[
        "tenants"
    ]


def workloads(
    served: Served, tenants: list[str], min_calls: int, max_calls: int, max_new_cap: int, sessions: bool = False
):
    """One interleaving: `min_calls` to `max_calls` calls, from every tenant; with `sessions`,
    some of them continue a session (SGLang's sessions: the single topology)."""
    if MARKER_BASE + MARKER_LEN * len(tenants) > 512:
        raise ValueError("too many tenants for the marker space")
    p = served.page

    def tokens(seed: int, n: int) -> list[int]:
        # Tokens come from a drawn seed, not one draw each: a workload of ~30 prompts of up to the
        # limit would exceed what Hypothesis draws for one example.
        rng = random.Random(seed)
        return [rng.randint(*TOKENS) for _ in range(n)]

    @st.composite
    def draw_workload(draw) -> list[Call]:
        # Prefixes two or more calls share: across tenants, and page-aligned or not.
        lengths = st.one_of(st.just(p), st.integers(1, 2 * p + 7))
        shared = [tokens(draw(st.integers(0, 2**32)), draw(lengths)) for _ in range(draw(st.integers(1, 3)))]
        calls = []
        for _ in range(draw(st.integers(min_calls, max_calls))):
            tenant = draw(st.sampled_from(tenants))
            # mostly served (what isolation is about), some at and over the limit (admission)
            kind = draw(st.sampled_from(["tiny", "short", "short", "short", "long", "long", "at_limit", "over"]))
            length = {
                "tiny": draw(st.integers(MARKER_LEN + 1, 12)),
                "short": draw(st.integers(13, min(100, served.max_prompt))),
                "long": draw(st.integers(min(101, served.max_prompt), served.max_prompt)),
                "at_limit": served.max_prompt,
                "over": served.max_prompt + draw(st.integers(1, 40)),
            }[kind]
            body = list(marker(tenants, tenant))
            if draw(st.booleans()):
                # within a tenant the marker leads (its pages can be shared); across tenants a
                # shared prefix leads and the marker follows it
                prefix = draw(st.sampled_from(shared))[: length - MARKER_LEN]  # the marker always fits
                body = list(prefix) + body if draw(st.booleans()) else body + list(prefix)
            body = (body + tokens(draw(st.integers(0, 2**32)), length))[:length]
            then: list[int] = []
            if sessions and kind in ("tiny", "short") and draw(st.sampled_from((False,) * 4 + (True,))):
                # turn 2 brings the whole (history + its input) anywhere from short to over the limit
                total = draw(
                    st.one_of(
                        st.integers(length + FIRST_TURN + 1, served.max_prompt),
                        st.just(served.max_prompt),
                        st.integers(served.max_prompt + 1, served.max_prompt + 40),
                    )
                )
                then = (list(marker(tenants, tenant)) + tokens(draw(st.integers(0, 2**32)), total))[
                    : total - length - FIRST_TURN
                ]
                length = total
            budget = served.max_model_len - length
            if budget < 1:  # an over-length prompt: refused whatever it asks
                max_new = draw(st.integers(1, max_new_cap))
            else:
                asks = draw(st.sampled_from(["within"] * 6 + ["over_budget", "unset"]))
                if asks == "over_budget":  # one token more than the budget: 400
                    max_new = budget + 1
                elif asks == "unset" and budget <= max_new_cap:  # the rest of the budget
                    max_new = None
                else:  # served whole
                    max_new = draw(st.integers(1, min(max_new_cap, budget)))
            stream = draw(st.booleans())
            disconnect = draw(st.sampled_from((None, None, None, "before_first", "mid"))) if stream else None
            abort = stream and disconnect is None and draw(st.sampled_from((False, False, True)))
            calls.append(Call(tenant, tuple(body), max_new, stream, disconnect, abort=abort, then=tuple(then)))
        return calls

    return draw_workload()

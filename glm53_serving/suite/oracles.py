"""The oracles: each one judges the outcomes of an interleaving on its own and names what it saw."""

from __future__ import annotations

import re
from dataclasses import dataclass

from glm53_serving.suite.workload import MARKER_LEN, Call, Served, marker

ORACLES = ("differential", "canary", "status", "drain", "allocator")
# what they report is another tenant's data, or may be (a failing allocator machine: a slot handed
# out unzeroed, or a row reading another owner's page)
LEAK_ORACLES = ("differential", "canary", "allocator")


@dataclass(slots=True)
class Outcome:
    status: int | None  # None: the client left before the response began
    code: str | None  # the contract's error code, in a 4xx/5xx body or an SSE error event
    output_ids: list[int] | None  # the whole generation (a stream's last event carries it all)
    body: str  # everything the client received, for the canary
    seconds: float
    left: bool  # the client disconnected on purpose
    finish: str | None = None  # a 200's finish_reason type: "length", or "abort" for an aborted call
    # A session continuation's turn 2 as the one call it amounts to (Call.continued), or its first
    # turn if that failed; what the oracles judge it as. None: the call itself.
    effective: Call | None = None


@dataclass(frozen=True, slots=True)
class Finding:
    oracle: str
    call: int | None
    detail: str


def predicted(call: Call, served: Served) -> tuple[int, str | None]:
    """The status and code docs/admission.md's formula gives this call."""
    n = len(call.prompt)
    if n > served.max_prompt:
        return 400, "context_length_exceeded"
    if call.max_new is not None and served.max_output is not None and call.max_new > served.max_output:
        return 400, "max_tokens_exceeded"
    if call.max_new is not None and n + call.max_new > served.max_model_len:
        return 400, "context_length_exceeded"
    return 200, None


def expected_tokens(call: Call, served: Served) -> int:
    if call.max_new is not None:
        return call.max_new
    budget = served.max_model_len - len(call.prompt)
    return budget if served.max_output is None else min(budget, served.max_output)


def status(calls: list[Call], outcomes: list[Outcome], served: Served, bound_s: float) -> list[Finding]:
    found = []
    for i, (c, o) in enumerate(zip(calls, outcomes)):
        if o.seconds > bound_s:
            found.append(Finding("status", i, f"answered after {o.seconds:.1f} s (bound {bound_s:.0f} s)"))
        if o.left and o.status is None:
            continue
        want = predicted(c, served)
        if (o.status, o.code) != want:
            found.append(Finding("status", i, f"got {o.status} {o.code}, the formula says {want[0]} {want[1]}"))
    return found


def own_prefix(o: Outcome, alone: list[int] | None) -> bool:
    """An aborted answer's tokens so far are the start of the call's own (solo) tokens."""
    return alone is None or o.output_ids is None or o.output_ids == alone[: len(o.output_ids)]


def differential(calls: list[Call], outcomes: list[Outcome], solo: dict, served: Served) -> list[Finding]:
    """Every whole 200 equals the same call served alone (greedy, ignore_eos)."""
    found = []
    for i, (c, o) in enumerate(zip(calls, outcomes)):
        if o.status != 200 or o.left or o.code is not None:
            continue
        alone = solo.get(c.solo_key)
        if c.abort and o.finish == "abort":  # what it got before the abort: its own tokens so far
            if not own_prefix(o, alone):
                found.append(Finding("differential", i, "an aborted call's tokens so far are not its own"))
            continue
        if o.output_ids is None or len(o.output_ids) != expected_tokens(c, served):
            found.append(
                Finding("differential", i, f"{len(o.output_ids or [])} tokens, not {expected_tokens(c, served)}")
            )
        elif alone is not None and o.output_ids != alone:
            k = next(j for j, (a, b) in enumerate(zip(o.output_ids, alone)) if a != b)
            found.append(
                Finding(
                    "differential",
                    i,
                    f"differs from its solo run at token {k}: {o.output_ids[k : k + 8]} vs {alone[k : k + 8]}",
                )
            )
    return found


def cross_topology(solo_by_topology: dict[str, dict]) -> list[Finding]:
    """PD equals colocated: a call served alone gets the same tokens from both."""
    if len(solo_by_topology) < 2:
        return []
    (a, sa), (b, sb) = list(solo_by_topology.items())[:2]
    return [
        Finding(
            "differential", None, f"{b} differs from {a} for a {len(k[0])}-token prompt: {sb[k][:8]} vs {sa[k][:8]}"
        )
        for k in sa.keys() & sb.keys()
        if sa[k] != sb[k]
    ]


def canary(calls: list[Call], outcomes: list[Outcome], tenants: list[str]) -> list[Finding]:
    """No response carries another tenant's marker tokens, or its name."""
    found = []
    names = {t: re.compile(rf"(?<![\w-]){re.escape(t)}(?![\w-])") for t in tenants}
    for i, (c, o) in enumerate(zip(calls, outcomes)):
        for other in tenants:
            if other == c.tenant:
                continue
            m = marker(tenants, other)
            ids = o.output_ids or []
            if any(tuple(ids[k : k + MARKER_LEN]) == m for k in range(len(ids) - MARKER_LEN + 1)):
                found.append(Finding("canary", i, f"{c.tenant}'s response holds {other}'s marker tokens {m}"))
            if names[other].search(o.body):
                found.append(Finding("canary", i, f"{c.tenant}'s response names tenant {other}"))
    return found


def drain(before: dict[str, dict], after: dict[str, dict]) -> list[Finding]:
    """After the workload no worker holds a request, every page in use is a prefix-cache page,
    and the owner tags mark exactly the pages in use; after a cache flush every page is free and
    none is owned. Each dict: worker -> its glm53_kv state (kv_guard.report_state)."""
    found = []
    for worker, s in before.items():
        used = s["pages"] - s["free_pages"]
        if s["running_requests"] or s["queued_requests"] or s.get("deferred_releases"):
            found.append(
                Finding(
                    "drain",
                    None,
                    f"{worker} holds {s['running_requests']} running, {s['queued_requests']} queued, "
                    f"{s.get('deferred_releases', 0)} awaiting a deferred KV release",
                )
            )
        elif not s["idle"]:
            found.append(Finding("drain", None, f"{worker} holds no request but SGLang does not count it idle"))
        if used != s["evictable_pages"]:
            found.append(
                Finding("drain", None, f"{worker}: {used} pages in use, {s['evictable_pages']} of them cached")
            )
        if s["owned_pages"] is not None and s["owned_pages"] != used:
            found.append(Finding("drain", None, f"{worker}: {s['owned_pages']} pages owned, {used} in use"))
    for worker, s in after.items():
        if s["free_pages"] != s["pages"] or s["owned_pages"]:
            found.append(
                Finding(
                    "drain",
                    None,
                    f"{worker} after a flush: {s['free_pages']} of {s['pages']} pages free, {s['owned_pages']} owned",
                )
            )
    return found

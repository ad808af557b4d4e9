"""PD handoff check: decode decodes only over a prompt whose KV prefill actually sent.

Invariant: a PD decode server starts decoding a request only if the prefill server reports, in
the request's metadata slot, the same prompt length as the KV destination decode pre-allocated
for it, and every slot of that prompt holds written KV in each kind of buffer the transfer
carries: the latent (or K/V) rows, and for DSA the index-K pages, which travel on a channel of
their own (the pool's "state" buffers). Any other length (or none: a prefill without this plugin
writes 0), or a slot that still reads zero, aborts that request with HTTP 500
`kv_handoff_mismatch` before its first decode step.

Attack/incident closed: in the incident, prefill forwarded a one-token placeholder for an
over-length prompt and decode attended over the rest of its pre-allocated pages, which nothing
had written (upstream today: prefill and decode truncating to different lengths). Decode cannot
see which pages a transfer wrote; it can compare the length prefill says it sent, and, because
the "zero" part hands the destination out zeroed, count the prompt slots that still read zero,
per buffer kind, and compare that with the count prefill says it sent. Real KV is almost never
zero, but a token whose embedding row is zero (padding, in a model without biases) gives a zero
latent row in every layer, and a client may send one: prefill counts, so that only a slot the
transfer left unwritten is a mismatch. One layer of each buffer kind is read (the last that has
rows: a transfer sends a page in every layer or fails), as integers of the element's width so
that a -0.0 counts as written.

How: the metadata buffer's `cached_tokens` row is int32 (size, 16) and slots 7-15 are unused
upstream (disaggregation/utils.py MetadataBuffers.set_buf). Prefill writes
`len(req.origin_input_ids)` into `LENGTH_SLOT` and its zero counts into `ZERO_SLOTS` (AFTER
set_buf, when the prompt's KV is computed and about to be sent); decode compares the length with
`req.kv.kv_committed_len`, the length `_pre_alloc` reserved and published, and the counts with
its own (AFTER `DecodeTransferQueue._commit_transfer_to_req`), and clears the slots so a later
owner of the metadata slot can never pass on a stale value. No wire layout changes.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import torch

from glm53_serving import events, kv_zero
from glm53_serving.errors import KV_HANDOFF_MESSAGE
from glm53_serving.metrics import KV_VIOLATIONS

logger = logging.getLogger("glm53_serving")

LENGTH_SLOT = 7
ZERO_SLOTS = (8, 9)  # prompt slots prefill sent that read zero: KV rows, index-K scales
KINDS = ("KV slots", "index-K slots")
MISMATCH_CODE = "kv_handoff_mismatch"  # FINISH_ABORT.err_type; http_guard maps it to the contract


# (req_to_token_pool, allocator) of this process's prefill scheduler (attach(), at start-up):
# MetadataBuffers.set_buf, where prefill writes what it sends, sees only the request.
_prefill_memory: tuple | None = None


def attach(scheduler) -> None:
    """Start-up, on a PD prefill scheduler: where carry_prompt_length reads the sent KV."""
    global _prefill_memory
    _prefill_memory = (scheduler.req_to_token_pool, scheduler.token_to_kv_pool_allocator)


def carry_prompt_length(result, self, req, *args, **kwargs):
    """Prefill, AFTER MetadataBuffers.set_buf: the prompt length, and how many of the prompt's
    slots it sends read zero per buffer kind (a prompt can hold such tokens: a zero embedding
    row, e.g. padding, gives zero KV in a model without biases); -1 where it cannot tell."""
    row = self.cached_tokens[req.metadata_buffer_index]
    n = len(req.origin_input_ids)
    row[LENGTH_SLOT] = n
    zeros = [-1] * len(ZERO_SLOTS)
    if _prefill_memory is not None:
        req_to_token_pool, allocator = _prefill_memory
        slots = req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n]
        zeros = zero_counts(allocator.get_kvcache(), slots)
    for slot, count in zip(ZERO_SLOTS, zeros):
        row[slot] = count
    return result


def expected_length(req) -> int:
    return int(req.kv.kv_committed_len)


def check_prompt_length(result, self, decode_req, *args, **kwargs):
    """Decode, AFTER DecodeTransferQueue._commit_transfer_to_req (before the request can join a batch)."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer, prepare_abort
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req = decode_req.req
    idx = decode_req.metadata_buffer_index
    row = self.metadata_buffers.cached_tokens[idx]
    carried, sent_zero = int(row[LENGTH_SLOT]), [int(row[s]) for s in ZERO_SLOTS]
    for slot in (LENGTH_SLOT, *ZERO_SLOTS):  # a later user of the metadata slot sees nothing stale
        row[slot] = 0
    if isinstance(req.finished_reason, FINISH_ABORT) or _is_fake_transfer(req):
        # Already aborted; or no prefill involved at all: the server's own health probe (intake
        # refuses the fake bootstrap host from clients, server_flags the fake transfer backend).
        # A retraction re-bootstrap is checked like any transfer: prefill recomputes
        # origin + output tokens (Req.build_rebootstrap_payload) and decode pre-allocated exactly
        # that (DecodePreallocQueue._pre_alloc_fill_len).
        return result
    expected = expected_length(req)
    if carried != expected:
        why = f"prefill sent KV for {carried} prompt tokens, decode expected {expected}"
        _abort(req, prepare_abort, why, carried=carried, expected=expected)
        return result
    scheduler = self.scheduler
    slots = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :expected]
    found = zero_counts(scheduler.token_to_kv_pool_allocator.get_kvcache(), slots)
    missing = {what: got - sent for what, got, sent in zip(KINDS, found, sent_zero) if got != sent}
    if missing:
        why = (
            f"prefill's transfer left {', '.join(f'{n} {what}' for what, n in missing.items())} unwritten "
            f"(zero on decode: {found}, as sent: {sent_zero})"
        )
        _abort(req, prepare_abort, why, carried=carried, expected=expected, unwritten=missing)
    return result


def _abort(req, prepare_abort, why: str, **event) -> None:
    logger.error("glm53_serving PD handoff mismatch: request %s, %s. Aborting it before decoding.", req.rid, why)
    KV_VIOLATIONS.inc(where="handoff")
    events.record("kv_handoff_mismatch", rid=req.rid, **event)
    prepare_abort(
        req,
        f"{KV_HANDOFF_MESSAGE} {why}; the request was aborted before decoding.",
        status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
    )
    req.finished_reason.err_type = MISMATCH_CODE
    req.skip_radix_cache_insert = True


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def zero_counts(pool, slots: torch.Tensor) -> list[int]:
    """How many of `slots` read zero, per buffer kind (KINDS; 0 index-K slots where the pool
    has none). One device-to-host sync."""
    slots = slots.to(torch.int64)
    last = kv_zero.layer_buffers(pool)[-1]
    rows = last[slots]
    rows = rows.view(_INT_OF_WIDTH[rows.element_size()]).reshape(slots.numel(), -1)
    counts = [(~(rows != 0).any(dim=1)).sum()]
    if type(pool).__name__ == "DSATokenToKVPool":
        _, scales = kv_zero.index_k_parts(pool)[-1]
        p = pool.page_size
        scales = scales[slots // p, slots % p]
        counts.append((~(scales != 0).any(dim=1)).sum())
    else:
        counts.append(torch.zeros((), dtype=counts[0].dtype, device=counts[0].device))
    return torch.stack(counts).tolist()

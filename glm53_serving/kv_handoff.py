"""PD handoff length check: decode decodes only over a prompt whose KV prefill actually sent.

Invariant: a PD decode server starts decoding a request only if the prefill server reports, in
the request's metadata slot, the same prompt length as the KV destination decode pre-allocated
for it. Any other length (or none: a prefill without this plugin writes 0) aborts that request
with HTTP 500 `kv_handoff_mismatch` before its first decode step.

Attack/incident closed: in the incident, prefill forwarded a one-token placeholder for an
over-length prompt and decode attended over the rest of its pre-allocated pages, which nothing
had written (upstream today: prefill and decode truncating to different lengths). Decode cannot
see which pages a transfer wrote; it can compare the length prefill says it sent.

How: the metadata buffer's `cached_tokens` row is int32 (size, 16) and slots 7-15 are unused
upstream (disaggregation/utils.py MetadataBuffers.set_buf). Prefill writes
`len(req.origin_input_ids)` into `LENGTH_SLOT` (AFTER set_buf); decode compares it with
`req.kv.kv_committed_len`, the length `_pre_alloc` reserved and published (AFTER
`DecodeTransferQueue._commit_transfer_to_req`), and clears the slot so a later owner of the
metadata slot can never pass on a stale value. No wire layout changes.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from glm53_serving import events
from glm53_serving.errors import KV_HANDOFF_MESSAGE
from glm53_serving.metrics import KV_VIOLATIONS

logger = logging.getLogger("glm53_serving")

LENGTH_SLOT = 7
MISMATCH_CODE = "kv_handoff_mismatch"  # FINISH_ABORT.err_type; http_guard maps it to the contract


def carry_prompt_length(result, self, req, *args, **kwargs):
    """Prefill, AFTER MetadataBuffers.set_buf."""
    self.cached_tokens[req.metadata_buffer_index][LENGTH_SLOT] = len(req.origin_input_ids)
    return result


def expected_length(req) -> int:
    return int(req.kv.kv_committed_len)


def check_prompt_length(result, self, decode_req, *args, **kwargs):
    """Decode, AFTER DecodeTransferQueue._commit_transfer_to_req (before the request can join a batch)."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer, prepare_abort
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req = decode_req.req
    idx = decode_req.metadata_buffer_index
    carried = int(self.metadata_buffers.cached_tokens[idx][LENGTH_SLOT])
    self.metadata_buffers.cached_tokens[idx][LENGTH_SLOT] = 0
    if isinstance(req.finished_reason, FINISH_ABORT) or _is_fake_transfer(req):
        # Already aborted; or no prefill involved at all: the server's own health probe (intake
        # refuses the fake bootstrap host from clients, server_flags the fake transfer backend).
        # A retraction re-bootstrap is checked like any transfer: prefill recomputes
        # origin + output tokens (Req.build_rebootstrap_payload) and decode pre-allocated exactly
        # that (DecodePreallocQueue._pre_alloc_fill_len).
        return result
    expected = expected_length(req)
    if carried != expected:
        logger.error(
            "glm53_serving PD handoff length mismatch: request %s, prefill sent KV for %d prompt tokens, "
            "decode pre-allocated %d. Aborting this request before decoding.",
            req.rid,
            carried,
            expected,
        )
        KV_VIOLATIONS.inc(where="handoff")
        events.record("kv_handoff_mismatch", rid=req.rid, carried=carried, expected=expected)
        prepare_abort(
            req,
            f"{KV_HANDOFF_MESSAGE} prefill sent KV for {carried} prompt tokens, decode expected "
            f"{expected}; the request was aborted before decoding.",
            status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
        )
        req.finished_reason.err_type = MISMATCH_CODE
        req.skip_radix_cache_insert = True
    return result

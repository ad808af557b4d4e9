"""The PD handoff length check on SGLang's real metadata buffers, requests and decode requests:
decode decodes only a prompt whose KV prefill says it sent, exactly; any other length is the
contract's kv_handoff_mismatch before the first decode step."""

from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.disaggregation.decode import DecodeRequest
from sglang.srt.disaggregation.utils import MetadataBuffers
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
from sglang.srt.sampling.sampling_params import SamplingParams

from glm53_serving import kv_handoff
from glm53_serving.errors import KV_HANDOFF_MESSAGE


def buffers():
    return MetadataBuffers(4, hidden_size=8, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=1)


def prompt_req(n: int, rid="r") -> Req:
    req = Req(rid, "", array("q", [5] * n), SamplingParams(), bootstrap_host="127.0.0.1", bootstrap_room=7)
    req.metadata_buffer_index = 1
    return req


def decode_side(prompt_len: int, carried: int | None, **kw):
    """Decode's request pre-allocated for `prompt_len` tokens; prefill (or nobody) wrote `carried`."""
    buf = buffers()
    if carried is not None:  # prefill ran carry_prompt_length (AFTER its set_buf) for a prompt of that length
        kv_handoff.carry_prompt_length(None, buf, prompt_req(carried))
    req = prompt_req(prompt_len)
    req.kv.kv_committed_len = prompt_len
    decode_req = DecodeRequest(req=req, kv_receiver=None, metadata_buffer_index=1, **kw)
    kv_handoff.check_prompt_length(None, SimpleNamespace(metadata_buffers=buf), decode_req)
    return req, buf


def test_prefill_carries_the_prompt_length_in_the_spare_slot():
    buf = buffers()
    kv_handoff.carry_prompt_length(None, buf, prompt_req(137))
    assert int(buf.cached_tokens[1][kv_handoff.LENGTH_SLOT]) == 137


def test_the_exact_length_decodes_and_the_slot_is_cleared():
    req, buf = decode_side(137, 137)
    assert req.finished_reason is None and not req.skip_radix_cache_insert
    assert int(buf.cached_tokens[1][kv_handoff.LENGTH_SLOT]) == 0  # a later user of the slot sees no stale length


@pytest.mark.parametrize(
    "carried", [136, 138, 1, 10_000, None], ids=["short", "long", "one-token-stub", "huge", "no-plugin"]
)
def test_any_other_length_is_a_handoff_mismatch_before_decoding(carried):
    """Short (the incident's one-token stub), long, or none at all (a prefill without the plugin
    writes 0): aborted with the contract's code, never decoded, never cached."""
    req, _ = decode_side(137, carried)
    assert isinstance(req.finished_reason, FINISH_ABORT)
    assert req.finished_reason.err_type == kv_handoff.MISMATCH_CODE
    assert req.finished_reason.message.startswith(KV_HANDOFF_MESSAGE)
    assert req.skip_radix_cache_insert


@pytest.mark.parametrize("carried, aborted", [(137, False), (136, True), (1, True)])
def test_a_retraction_rebootstrap_is_checked_like_any_transfer(carried, aborted):
    # The check was skipped for re-bootstrapped transfers: a short one decoded unchecked.
    req, _ = decode_side(137, carried, is_rebootstrap=True)
    assert isinstance(req.finished_reason, FINISH_ABORT) == aborted
    if aborted:
        assert req.finished_reason.err_type == kv_handoff.MISMATCH_CODE

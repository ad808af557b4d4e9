"""The PD handoff check on SGLang's real metadata buffers, requests, decode requests and KV pools:
decode decodes only a prompt whose KV prefill says it sent, exactly, and whose every slot the
transfer wrote (latent or K/V rows, and DSA's index-K pages); anything else is the contract's
kv_handoff_mismatch before the first decode step."""

from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.disaggregation.decode import DecodeRequest
from sglang.srt.disaggregation.utils import MetadataBuffers
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams

from glm53_serving import kv_handoff
from glm53_serving.errors import KV_HANDOFF_MESSAGE
from tests.unit.test_kv_zero import make as make_pool
from tests.unit.test_kv_zero import slot_views


def buffers():
    return MetadataBuffers(4, hidden_size=8, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=1)


def prompt_req(n: int, rid="r") -> Req:
    req = Req(rid, "", array("q", [5] * n), SamplingParams(), bootstrap_host="127.0.0.1", bootstrap_room=7)
    req.metadata_buffer_index = 1
    return req


def written_scheduler(prompt_len: int, pool=None, alloc=None):
    """Decode's scheduler memory with the prompt's destination in row 0, every slot written."""
    if pool is None:
        pool = MHATokenToKVPool(256, 1, torch.float32, 2, 4, 2, "cpu", False)
        alloc = TokenToKVPoolAllocator(256, torch.float32, "cpu", pool, False)
    r2t = ReqToTokenPool(2, 256, "cpu", False)
    slots = torch.arange(alloc.page_size, alloc.page_size + prompt_len)  # past the padding page
    r2t.req_to_token[0, :prompt_len] = slots.to(torch.int32)
    for t, idx in slot_views(pool, slots):
        t[idx] = 1
    return SimpleNamespace(req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc), pool, slots


@pytest.fixture(autouse=True)
def no_prefill_memory(monkeypatch):
    monkeypatch.setattr(kv_handoff, "_prefill_memory", None)


def prefill_side(buf, n: int, scheduler) -> None:
    """Prefill ran carry_prompt_length (AFTER its set_buf) for a prompt of n tokens, its KV in
    `scheduler`'s pool (the same pool as decode's here: what the transfer copies)."""
    kv_handoff.attach(scheduler)
    req = prompt_req(n)
    req.kv.req_pool_idx = 0
    kv_handoff.carry_prompt_length(None, buf, req)


def decode_side(prompt_len: int, carried: int | None, scheduler=None, **kw):
    """Decode's request pre-allocated for `prompt_len` tokens; prefill (or nobody) wrote `carried`."""
    buf = buffers()
    scheduler = scheduler or written_scheduler(prompt_len)[0]
    if carried is not None:
        prefill_side(buf, carried, scheduler)
    req = prompt_req(prompt_len)
    req.kv.kv_committed_len = prompt_len
    req.kv.req_pool_idx = 0
    decode_req = DecodeRequest(req=req, kv_receiver=None, metadata_buffer_index=1, **kw)
    kv_handoff.check_prompt_length(None, SimpleNamespace(metadata_buffers=buf, scheduler=scheduler), decode_req)
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


def handoff(scheduler, n, lost=None):
    """Prefill counts and sends n prompt slots; `lost(pool)` then zeroes what the transfer did
    not write on decode; decode checks. Returns decode's request."""
    buf = buffers()
    prefill_side(buf, n, scheduler)
    if lost is not None:
        lost(scheduler.token_to_kv_pool_allocator.get_kvcache())
    req = prompt_req(n)
    req.kv.kv_committed_len = n
    req.kv.req_pool_idx = 0
    decode_req = DecodeRequest(req=req, kv_receiver=None, metadata_buffer_index=1)
    kv_handoff.check_prompt_length(None, SimpleNamespace(metadata_buffers=buf, scheduler=scheduler), decode_req)
    assert all(int(buf.cached_tokens[1][s]) == 0 for s in (kv_handoff.LENGTH_SLOT, *kv_handoff.ZERO_SLOTS))
    return req


def test_a_slot_the_transfer_did_not_write_is_a_handoff_mismatch():
    # The length is right, but one prompt slot reads zero on decode that prefill sent written.
    scheduler, pool, slots = written_scheduler(137)

    def lost(pool, value=0.0):
        pool.v_buffer[-1][slots[50]] = value

    assert handoff(scheduler, 137, lambda p: lost(p, -0.0)).finished_reason is None  # -0.0: written bytes
    req = handoff(scheduler, 137, lost)
    assert req.finished_reason.err_type == kv_handoff.MISMATCH_CODE
    assert "left 1 KV slots unwritten" in req.finished_reason.message


def test_a_prompt_token_whose_kv_is_zero_on_prefill_too_is_served():
    # A zero embedding row (token 0 of the tiny models, a padding token) gives zero KV: prefill
    # counts it, decode finds the same count (a fuzzed [0] prompt got a 500 before prefill counted).
    scheduler, pool, slots = written_scheduler(137)
    pool.v_buffer[-1][slots[:3]] = 0
    pool.k_buffer[-1][slots[:3]] = 0
    assert handoff(scheduler, 137).finished_reason is None
    req = handoff(scheduler, 137, lambda p: p.v_buffer[-1].__setitem__(slots[3], 0))  # and one more lost
    assert "left 1 KV slots unwritten" in req.finished_reason.message


def test_a_prefill_that_could_not_count_is_a_mismatch():
    scheduler, _, _ = written_scheduler(137)
    buf = buffers()
    kv_handoff.carry_prompt_length(None, buf, prompt_req(137))  # no attach(): counts -1
    assert [int(buf.cached_tokens[1][s]) for s in kv_handoff.ZERO_SLOTS] == [-1, -1]


@pytest.mark.parametrize("kind", ["latent", "index-K"])
def test_dsa_latent_and_index_k_pages_are_both_checked(kind):
    # GLM-5.3's pool: 64-token pages; the index-K pages travel on their own channel.
    pool, alloc = make_pool(64, dsa=True)
    scheduler, _, slots = written_scheduler(130, pool, alloc)
    assert handoff(scheduler, 130).finished_reason is None
    last_page = slots[128:]  # the prompt's partly filled last page: 2 of 64 slots

    def lost(pool):
        if kind == "latent":
            pool.kv_buffer[-1][last_page] = 0
        else:  # the index keys' fp32 scales of that page, in IndexKeyCache's layout
            buf, p = pool.index_key_cache.buffer[-1], pool.page_size
            buf[:, p * pool.index_head_dim :].view(buf.shape[0], p, -1)[last_page // p, last_page % p] = 0

    req = handoff(scheduler, 130, lost)
    assert req.finished_reason.err_type == kv_handoff.MISMATCH_CODE
    what = "KV slots" if kind == "latent" else "index-K slots"
    assert f"left 2 {what} unwritten" in req.finished_reason.message, req.finished_reason.message

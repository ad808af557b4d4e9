"""Test harness, never installed: KV faults and an ordering probe inside real SGLang servers.

Put this directory on PYTHONPATH (spawned SGLang children inherit it) and set any of:

- GLM53_TEST_KV_FOREIGN=<marker>: when a batch is built for a request whose rid contains the
  marker, its req_to_token row gets, at position 0, the index of a live slot that another
  namespace owns (the incident's situation: a row reaching another tenant's KV). If no foreign
  slot is live yet, the owner tag of the row's own first page is corrupted instead. Runs before
  glm53_serving's own hook on the same target (registered first, so innermost), so the owner
  check sees the fault exactly as a real bug would leave it.
- GLM53_TEST_KV_SHORT_HANDOFF=<marker>: PD decode reads a prompt length one token short from
  the metadata slot of such a request (a transfer that did not cover what decode pre-allocated).
- GLM53_TEST_KV_LOG=<file>: PD decode appends one JSON line per published destination: whether
  every page whose index is being sent to prefill reads zero in every layer buffer, at the moment
  it is sent (the ordering of zeroing and publishing).
"""

import json
import os

_FOREIGN = os.environ.get("GLM53_TEST_KV_FOREIGN")
_SHORT = os.environ.get("GLM53_TEST_KV_SHORT_HANDOFF")
_LOG = os.environ.get("GLM53_TEST_KV_LOG")


def _log(**event):
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(json.dumps(event) + "\n")


def _inject_foreign(result, batch, *args, **kwargs):
    import torch

    from glm53_serving import kv_owner

    _out, rows, _ = result
    allocator = batch.tree_cache.token_to_kv_pool_allocator
    tags = kv_owner.tags_of(allocator)
    r2t = batch.req_to_token_pool.req_to_token
    for i, req in enumerate(batch.reqs):
        if _FOREIGN not in str(req.rid):
            continue
        owner = kv_owner.owner_of(req)
        others = torch.nonzero((tags != 0) & (tags != owner)).flatten()
        row = int(rows[i])
        if others.numel():
            slot = int(others[0]) * allocator.page_size
            r2t[row, 0] = slot
            _log(fault="foreign_index", rid=req.rid, slot=slot, owner=int(tags[others[0]]))
        else:
            page = int(r2t[row, 0]) // allocator.page_size
            tags[page] = owner + 1
            _log(fault="corrupt_tag", rid=req.rid, page=page)
    return result


def _short_handoff(self, decode_req, *args, **kwargs):
    if _SHORT in str(decode_req.req.rid):
        from glm53_serving.kv_handoff import LENGTH_SLOT

        self.metadata_buffers.cached_tokens[decode_req.metadata_buffer_index][LENGTH_SLOT] -= 1
        _log(fault="short_handoff", rid=decode_req.req.rid)
    return None


def _probe_publish(self, decode_req, kv_indices, page_size, *args, **kwargs):
    import torch

    from glm53_serving import kv_guard

    pool = self.token_to_kv_pool_allocator.get_kvcache()
    slots = torch.as_tensor(kv_indices, dtype=torch.int64)
    zero = all(int(torch.count_nonzero(b[slots])) == 0 for b in kv_guard.layer_buffers(pool))
    _log(event="publish", rid=decode_req.req.rid, slots=int(slots.numel()), all_zero=zero)
    return None


if _FOREIGN or _SHORT or _LOG:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if _FOREIGN:
        HookRegistry.register("sglang.srt.mem_cache.allocation.alloc_for_extend", _inject_foreign, HookType.AFTER)
    if _SHORT:
        HookRegistry.register("sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req",
                              _short_handoff, HookType.BEFORE)
    if _LOG:
        HookRegistry.register("sglang.srt.disaggregation.decode.DecodePreallocQueue._send_kv_metadata",
                              _probe_publish, HookType.BEFORE)

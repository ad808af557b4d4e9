"""Test harness, never installed: KV faults and an ordering probe inside real SGLang servers.

Put this directory on PYTHONPATH (spawned SGLang children inherit it) and set any of:

- GLM53_TEST_KV_FOREIGN=<marker>: when an extend batch is built for a request whose rid
  contains the marker, its req_to_token row gets, at its first new position, the index of a live
  slot that another namespace owns (the incident's situation: a row reaching another tenant's
  KV). If no other namespace has a live slot, nothing is injected and the log says so
  (`no_foreign_slot`): a test must arrange for one (another tenant's cached prompt, or another
  tenant's request decoding at the same time) and read the log to prove the fault fired.
  Runs before glm53_serving's own hook on the same target (registered first, so innermost), so
  the owner check sees the fault exactly as a real bug would leave it.
- GLM53_TEST_KV_FOREIGN_DECODE=<marker>: the same at such a request's first decode step (in PD:
  decode's first step after the transfer), on its new position.
- GLM53_TEST_KV_POISON_TAIL=<marker>: at every batch build of such a request, its row beyond
  the request's length is filled with another namespace's live slot (stale row residue at its
  worst): the output must not change and no check may fail, because nothing reads past the length.
- GLM53_TEST_KV_SHORT_HANDOFF=<marker>, GLM53_TEST_KV_LONG_HANDOFF=<marker>: PD decode reads a
  prompt length one token short (long) from the metadata slot of such a request (a transfer that
  did not cover exactly what decode pre-allocated).
- GLM53_TEST_KV_REBOOTSTRAP_SHORT=<marker>: the same one token short, on a transfer marked as a
  retraction re-bootstrap (`is_rebootstrap`, which the check once skipped).
- GLM53_TEST_KV_LOG=<file>: PD decode appends one JSON line per published destination: whether
  every page whose index is being sent to prefill reads zero in every layer buffer, at the moment
  it is sent (the ordering of zeroing and publishing).
"""

import json
import os

_FOREIGN = os.environ.get("GLM53_TEST_KV_FOREIGN")
_FOREIGN_DECODE = os.environ.get("GLM53_TEST_KV_FOREIGN_DECODE")
_SHORT = os.environ.get("GLM53_TEST_KV_SHORT_HANDOFF")
_LONG = os.environ.get("GLM53_TEST_KV_LONG_HANDOFF")
_REBOOTSTRAP = os.environ.get("GLM53_TEST_KV_REBOOTSTRAP_SHORT")
_POISON = os.environ.get("GLM53_TEST_KV_POISON_TAIL")
_LOG = os.environ.get("GLM53_TEST_KV_LOG")


def _log(**event):
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(json.dumps(event) + "\n")


def _inject(batch, rows, positions, marker, where):
    from glm53_serving import kv_owner

    allocator = batch.tree_cache.token_to_kv_pool_allocator
    tags = kv_owner.tags_of(allocator)
    r2t = batch.req_to_token_pool.req_to_token
    for i, req in enumerate(batch.reqs):
        # Once per request object (a router retry is a new one, and is faulted again), never
        # again after the guard quarantined it: that would be a second, unrelated bug.
        if marker is None or marker not in str(req.rid) or req.__dict__.get("_kvfault_" + where):
            continue
        req.__dict__["_kvfault_" + where] = True
        owner = kv_owner.owner_of(req)
        row, pos = int(rows[i]), int(positions[i])
        slot = _foreign_slot(allocator, owner)
        if slot is None:
            _log(fault="no_foreign_slot", where=where, rid=req.rid, pos=pos)
            continue
        r2t[row, pos] = slot
        page = slot // allocator.page_size
        _log(fault="foreign_index", where=where, rid=req.rid, pos=pos, slot=slot, owner=int(tags[page]), own=owner)


def _inject_foreign(result, batch, *args, **kwargs):
    _inject(batch, result[1], batch.prefix_lens, _FOREIGN, "extend")
    return result


def _inject_foreign_decode(result, batch, *args, **kwargs):
    _inject(batch, batch.req_pool_indices, batch.seq_lens_cpu, _FOREIGN_DECODE, "decode")
    return result


def _foreign_slot(allocator, owner):
    import torch

    from glm53_serving import kv_owner

    tags = kv_owner.tags_of(allocator)
    others = torch.nonzero((tags != 0) & (tags != owner)).flatten()
    return int(others[0]) * allocator.page_size if others.numel() else None


def _poison(batch, rows, lens, where):
    from glm53_serving import kv_owner

    allocator = batch.tree_cache.token_to_kv_pool_allocator
    r2t = batch.req_to_token_pool.req_to_token
    for i, req in enumerate(batch.reqs):
        if _POISON is not None and _POISON in str(req.rid):
            foreign = _foreign_slot(allocator, kv_owner.owner_of(req))
            slot = allocator.size if foreign is None else foreign  # the last slot: someone's or free
            r2t[int(rows[i]), int(lens[i]) :] = slot
            _log(
                fault="poison_tail",
                rid=req.rid,
                where=where,
                start=int(lens[i]),
                slot=slot,
                foreign=foreign is not None,
            )


def _poison_extend(result, batch, *args, **kwargs):
    _poison(batch, result[1], batch.seq_lens_cpu, "extend")
    return result


def _poison_decode(result, batch, token_per_req=1, *args, **kwargs):
    _poison(batch, batch.req_pool_indices, batch.seq_lens_cpu + token_per_req, "decode")
    return result


def _wrong_length_handoff(self, decode_req, *args, **kwargs):
    for marker, delta, fault in (
        (_SHORT, -1, "short_handoff"),
        (_LONG, 1, "long_handoff"),
        (_REBOOTSTRAP, -1, "rebootstrap_short_handoff"),
    ):
        if marker is not None and marker in str(decode_req.req.rid):
            if marker is _REBOOTSTRAP:
                decode_req.is_rebootstrap = True
            from glm53_serving.kv_handoff import LENGTH_SLOT

            self.metadata_buffers.cached_tokens[decode_req.metadata_buffer_index][LENGTH_SLOT] += delta
            _log(fault=fault, rid=decode_req.req.rid)
    return None


def _probe_publish(self, decode_req, kv_indices, page_size, *args, **kwargs):
    import torch

    from glm53_serving import kv_zero

    pool = self.token_to_kv_pool_allocator.get_kvcache()
    slots = torch.as_tensor(kv_indices, dtype=torch.int64)
    zero = all(int(torch.count_nonzero(b[slots])) == 0 for b in kv_zero.layer_buffers(pool))
    _log(event="publish", rid=decode_req.req.rid, slots=int(slots.numel()), all_zero=zero)
    return None


if _FOREIGN or _FOREIGN_DECODE or _SHORT or _LONG or _REBOOTSTRAP or _LOG or _POISON:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if _FOREIGN:
        HookRegistry.register("sglang.srt.mem_cache.allocation.alloc_for_extend", _inject_foreign, HookType.AFTER)
    if _FOREIGN_DECODE:
        HookRegistry.register(
            "sglang.srt.mem_cache.allocation.alloc_for_decode", _inject_foreign_decode, HookType.AFTER
        )
    if _POISON:
        HookRegistry.register("sglang.srt.mem_cache.allocation.alloc_for_extend", _poison_extend, HookType.AFTER)
        HookRegistry.register("sglang.srt.mem_cache.allocation.alloc_for_decode", _poison_decode, HookType.AFTER)
    if _SHORT or _LONG or _REBOOTSTRAP:
        HookRegistry.register(
            "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req",
            _wrong_length_handoff,
            HookType.BEFORE,
        )
    if _LOG:
        HookRegistry.register(
            "sglang.srt.disaggregation.decode.DecodePreallocQueue._send_kv_metadata", _probe_publish, HookType.BEFORE
        )

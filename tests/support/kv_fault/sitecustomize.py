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
- GLM53_TEST_KV_SHARE_PAGE=<marker>: when an extend batch is built for such a request, the
  allocator is made to hand it, at its first new position, a slot of another namespace's live,
  partly filled last page that its owner has not written yet (two owners on one page: the
  allocator fault that per-page owner tags exist for). The slot goes into the allocation itself
  (`out_cache_loc`, what the forward writes) and the row. The partly filled pages come from
  other requests' decode steps (a request of another tenant must be decoding); with none, the
  log says `no_shared_page` and nothing is injected.
- GLM53_TEST_KV_POISON_TAIL=<marker>: at every batch build of such a request, its row beyond
  the request's length is filled with another namespace's live slot (stale row residue at its
  worst): the output must not change and no check may fail, because nothing reads past the length.
- GLM53_TEST_KV_SHORT_HANDOFF=<marker>, GLM53_TEST_KV_LONG_HANDOFF=<marker>: PD decode reads a
  prompt length one token short (long) from the metadata slot of such a request (a transfer that
  did not cover exactly what decode pre-allocated).
- GLM53_TEST_KV_REBOOTSTRAP_SHORT=<marker>: the same one token short, on a transfer marked as a
  retraction re-bootstrap (`is_rebootstrap`, which the check once skipped).
- GLM53_TEST_KV_DROP_INDEX_K=<marker>, GLM53_TEST_KV_DROP_LATENT=<marker>: PD decode, once the
  transfer of such a request reports success, finds the index-K bytes (or the latent rows) of
  the prompt's last page zero in every layer: a transfer that did not carry that page on the
  index-K channel (or the KV one) although the length it reports is right.
- GLM53_TEST_KV_HOLD_TRANSFER=<marker>: PD decode, once the transfer of such a request reports
  success, keeps reporting it in flight for GLM53_TEST_KV_HOLD_S seconds (default 3) and logs
  `decode_transfer_held`, then `decode_transfer_released` with the status it then reports: the
  window in which an abort is pending while the transfer has already succeeded (sglang PR 33508).
- GLM53_TEST_KV_HOLD_PREFILL=<marker>: the same on PD prefill's side (the sender; the request stays
  in prefill's in-flight queue), logged as `prefill_transfer_held` / `_released`: the window for an
  abort that reaches prefill while decode goes on (sglang issue 32605).
- GLM53_TEST_KV_CANARY=<file>: a KV-level canary that does not trust the guard it watches (the
  isolation suite's, glm53_serving/suite): it keeps its own record of which cache namespace last
  wrote each slot (what the forward writes: `out_cache_loc`; in PD decode, the transfer's
  destination), and at every batch build appends a JSON line for each request whose row, up to
  its length, reaches a slot another namespace wrote (`kv_read_foreign`), and for each slot handed
  out that does not read zero in every layer buffer before its request writes it
  (`fresh_not_zero`). It runs before the plugin's own check on the same targets.
- GLM53_TEST_KV_LOG=<file>: PD decode appends one JSON line per published destination: whether
  every page whose index is being sent to prefill reads zero, all of its slots, in every layer
  buffer, and for DSA in every index-K row, at the moment it is sent (the ordering of zeroing and
  publishing, and zeroing whole pages).
"""

import json
import os

_FOREIGN = os.environ.get("GLM53_TEST_KV_FOREIGN")
_FOREIGN_DECODE = os.environ.get("GLM53_TEST_KV_FOREIGN_DECODE")
_SHORT = os.environ.get("GLM53_TEST_KV_SHORT_HANDOFF")
_LONG = os.environ.get("GLM53_TEST_KV_LONG_HANDOFF")
_REBOOTSTRAP = os.environ.get("GLM53_TEST_KV_REBOOTSTRAP_SHORT")
_POISON = os.environ.get("GLM53_TEST_KV_POISON_TAIL")
_SHARE = os.environ.get("GLM53_TEST_KV_SHARE_PAGE")
_DROP_INDEX_K = os.environ.get("GLM53_TEST_KV_DROP_INDEX_K")
_DROP_LATENT = os.environ.get("GLM53_TEST_KV_DROP_LATENT")
_HOLD = os.environ.get("GLM53_TEST_KV_HOLD_TRANSFER")
_HOLD_PREFILL = os.environ.get("GLM53_TEST_KV_HOLD_PREFILL")
_HOLD_S = float(os.environ.get("GLM53_TEST_KV_HOLD_S", "3"))
_CANARY = os.environ.get("GLM53_TEST_KV_CANARY")
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
        slot_owner = int(tags[slot // allocator.page_size])
        if not slot_owner and _CANARY:  # owner tags off: whom the canary saw write it
            slot_owner = int(_writer_table(allocator)[slot])
        _log(fault="foreign_index", where=where, rid=req.rid, pos=pos, slot=slot, owner=slot_owner, own=owner)


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
    if others.numel():
        return int(others[0]) * allocator.page_size
    if _CANARY:  # owner tags off (the incident reintroduced): a slot the canary saw another namespace write
        writers = _writer_table(allocator)
        others = torch.nonzero((writers != 0) & (writers != owner)).flatten()
        return int(others[-1]) if others.numel() else None
    return None


# rid -> (owner, last page, slots of it written) of requests seen at their latest decode step
_partial_pages: dict = {}
_MARGIN = 8  # the owner writes a slot per step: leave it this many steps before the stolen one


def _track_partial_pages(result, batch, token_per_req=1, *args, **kwargs):
    from glm53_serving import kv_owner

    p = batch.tree_cache.token_to_kv_pool_allocator.page_size
    for i, req in enumerate(batch.reqs):
        filled = (int(batch.seq_lens_cpu[i]) + token_per_req) % p
        page = int(result[(i + 1) * token_per_req - 1]) // p
        _partial_pages[req.rid] = (kv_owner.owner_of(req), page, filled)
    return result


def _share_page(result, batch, *args, **kwargs):
    from glm53_serving import kv_owner

    out_cache_loc, rows = result[0], result[1]
    allocator = batch.tree_cache.token_to_kv_pool_allocator
    p, tags = allocator.page_size, kv_owner.tags_of(allocator)
    r2t = batch.req_to_token_pool.req_to_token
    start = 0
    for i, req in enumerate(batch.reqs):
        pos, n = int(batch.prefix_lens[i]), int(batch.extend_lens[i])
        k, start = start, start + n
        if _SHARE not in str(req.rid) or req.__dict__.get("_kvfault_share"):
            continue
        req.__dict__["_kvfault_share"] = True
        own = kv_owner.owner_of(req)
        shared = [
            (owner, page, filled)
            for owner, page, filled in _partial_pages.values()
            if owner != own and 0 < filled <= p - _MARGIN and int(tags[page]) == owner
        ]
        if not shared:
            _log(fault="no_shared_page", where="extend", rid=req.rid, pos=pos)
            continue
        owner, page, filled = shared[-1]
        slot = page * p + p - 1  # the page's last slot: beyond what its owner has written
        displaced = int(out_cache_loc[k])
        out_cache_loc[k] = slot
        r2t[int(rows[i]), pos] = slot
        _log(
            fault="shared_page",
            where="extend",
            rid=req.rid,
            pos=pos,
            slot=slot,
            owner=owner,
            own=own,
            filled=filled,
            displaced=displaced,
        )
    return result


_writers: dict = {}  # id(allocator) -> int64 tensor: the namespace that last wrote each slot


def _canary_log(**event):
    with open(_CANARY, "a") as f:
        f.write(json.dumps(event) + "\n")


def _writer_table(allocator):
    import torch

    table = _writers.get(id(allocator))
    if table is None:
        table = _writers[id(allocator)] = torch.zeros(allocator.size + 2 * allocator.page_size, dtype=torch.int64)
    return table


def _canary(batch, rows, lens, fresh, counts, where):
    """`fresh`: the slots this batch build handed out, `counts[i]` of them request i's, in order."""
    import torch

    from glm53_serving import kv_owner, kv_zero

    allocator = batch.tree_cache.token_to_kv_pool_allocator
    writers = _writer_table(allocator)
    pool = allocator.get_kvcache()
    fresh = fresh.to(torch.int64)
    start = 0
    for i, req in enumerate(batch.reqs):
        mine = fresh[start : start + counts[i]]
        start += counts[i]
        owner = kv_owner.owner_of(req)
        dirty = sum(int(torch.count_nonzero(b[mine])) for b in kv_zero.layer_buffers(pool)) if mine.numel() else 0
        if dirty:
            _canary_log(event="fresh_not_zero", where=where, rid=req.rid, slots=int(mine.numel()), nonzero=dirty)
        writers[mine] = owner  # this forward writes them
        row = batch.req_to_token_pool.req_to_token[int(rows[i]), : int(lens[i])].to(torch.int64)
        wrote = writers[row]
        foreign = (wrote != 0) & (wrote != owner)
        if bool(foreign.any()):
            _canary_log(
                event="kv_read_foreign",
                where=where,
                rid=req.rid,
                own=owner,
                writers=sorted({int(w) for w in wrote[foreign].tolist()}),
                positions=int(foreign.sum()),
            )


def _canary_extend(result, batch, *args, **kwargs):
    _canary(batch, result[1], batch.seq_lens_cpu, result[0], list(batch.extend_lens), "extend")
    return result


def _canary_decode(result, batch, token_per_req=1, *args, **kwargs):
    _canary(
        batch,
        batch.req_pool_indices,
        batch.seq_lens_cpu + token_per_req,
        result,
        [token_per_req] * len(batch.reqs),
        "decode",
    )
    return result


def _canary_prealloc(kv_loc, queue, req, *args, **kwargs):
    """PD decode: the transfer writes the destination with the request's KV."""
    if kv_loc is not None:
        import torch

        from glm53_serving import kv_owner

        _writer_table(queue.token_to_kv_pool_allocator)[kv_loc.to(torch.int64)] = kv_owner.owner_of(req)
    return kv_loc


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


def _drop_page(self, decode_req, *args, **kwargs):
    import torch

    from glm53_serving import kv_zero

    req = decode_req.req
    for marker, fault in ((_DROP_INDEX_K, "dropped_index_k_page"), (_DROP_LATENT, "dropped_latent_page")):
        if marker is None or marker not in str(req.rid):
            continue
        scheduler = self.scheduler
        pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        n, p = int(req.kv.kv_committed_len), pool.page_size
        slots = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, (n - 1) // p * p : n].to(torch.int64)
        if fault == "dropped_latent_page":
            bufs = [(b, (slots,)) for b in kv_zero.layer_buffers(pool)]
        elif type(pool).__name__ == "DSATokenToKVPool":  # keys, then scales (IndexKeyCache's layout)
            key_bytes = p * pool.index_head_dim
            bufs = [
                (part.view(b.shape[0], p, -1), (slots // p, slots % p))
                for b in pool.index_key_cache.buffer
                if b.shape[0]
                for part in (b[:, :key_bytes], b[:, key_bytes:])
            ]
        else:
            _log(fault="no_index_k", rid=req.rid)
            continue
        for b, idx in bufs:
            b[idx] = 0
        _log(fault=fault, rid=req.rid, slots=int(slots.numel()), buffers=len(bufs))
    return None


def _hold(poller, rid: str, side: str) -> None:
    """From the first poll that reports the transfer succeeded, `poller` (a decode receiver or a
    prefill sender) reports it in flight for _HOLD_S seconds; its real poll still runs, so the
    success is recorded exactly as without the hold, and whatever happens meanwhile (an abort)
    is what it reports at release."""
    import time

    from sglang.srt.disaggregation.base.conn import KVPoll

    if getattr(poller, "_glm53_hold", None) is not None:
        return
    real, hold = poller.poll, {"until": None, "released": False}
    poller._glm53_hold = hold
    names = {v: k for k, v in vars(KVPoll).items() if isinstance(v, int)}

    def held_poll():
        status = real()
        if hold["until"] is None and status == KVPoll.Success:
            hold["until"] = time.time() + _HOLD_S
            _log(fault=f"{side}_transfer_held", rid=rid, t=time.time())
        if hold["until"] is None or hold["released"]:
            return status
        if time.time() < hold["until"]:
            return KVPoll.Transferring
        hold["released"] = True
        _log(fault=f"{side}_transfer_released", rid=rid, t=time.time(), status=names.get(int(status), status))
        return status

    poller.poll = held_poll


def _hold_decode_transfers(self, *args, **kwargs):
    """BEFORE DecodeTransferQueue.pop_transferred: hold the marked requests' receivers."""
    for decode_req in self.queue:
        if _HOLD in str(decode_req.req.rid):
            _hold(decode_req.kv_receiver, str(decode_req.req.rid), "decode")
    return None


def _hold_prefill_transfers(self, *args, **kwargs):
    """BEFORE the prefill scheduler's process_disagg_prefill_inflight_queue: hold the marked
    requests' senders (the request stays in prefill's in-flight queue meanwhile)."""
    for req in self.disagg_prefill_inflight_queue:
        if _HOLD_PREFILL in str(req.rid) and req.disagg_kv_sender is not None:
            _hold(req.disagg_kv_sender, str(req.rid), "prefill")
    return None


def _probe_publish(self, decode_req, kv_indices, page_size, *args, **kwargs):
    import torch

    from glm53_serving import kv_zero

    pool = self.token_to_kv_pool_allocator.get_kvcache()
    slots = torch.as_tensor(kv_indices, dtype=torch.int64)
    pages = torch.unique(slots // page_size)  # whole pages: their unwritten tails too
    slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
    zero = all(int(torch.count_nonzero(b[slots])) == 0 for b in kv_zero.layer_buffers(pool))
    index_k_layers = 0
    if type(pool).__name__ == "DSATokenToKVPool":  # the index-K rows of the pages, keys and scales
        for b in pool.index_key_cache.buffer:
            if b.shape[0]:
                index_k_layers += 1
                zero = zero and int(torch.count_nonzero(b[pages])) == 0
    _log(
        event="publish",
        rid=decode_req.req.rid,
        slots=int(slots.numel()),
        index_k_layers=index_k_layers,
        all_zero=zero,
    )
    return None


if (
    _FOREIGN
    or _FOREIGN_DECODE
    or _SHORT
    or _LONG
    or _REBOOTSTRAP
    or _LOG
    or _POISON
    or _SHARE
    or _DROP_INDEX_K
    or _DROP_LATENT
    or _HOLD
    or _HOLD_PREFILL
):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if _FOREIGN:
        HookRegistry.register("sglang.srt.mem_cache.allocation.alloc_for_extend", _inject_foreign, HookType.AFTER)
    if _FOREIGN_DECODE:
        HookRegistry.register(
            "sglang.srt.mem_cache.allocation.alloc_for_decode", _inject_foreign_decode, HookType.AFTER
        )
    if _SHARE:
        HookRegistry.register("sglang.srt.mem_cache.allocation.alloc_for_extend", _share_page, HookType.AFTER)
        HookRegistry.register("sglang.srt.mem_cache.allocation.alloc_for_decode", _track_partial_pages, HookType.AFTER)
    if _POISON:
        HookRegistry.register("sglang.srt.mem_cache.allocation.alloc_for_extend", _poison_extend, HookType.AFTER)
        HookRegistry.register("sglang.srt.mem_cache.allocation.alloc_for_decode", _poison_decode, HookType.AFTER)
    if _SHORT or _LONG or _REBOOTSTRAP:
        HookRegistry.register(
            "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req",
            _wrong_length_handoff,
            HookType.BEFORE,
        )
    if _DROP_INDEX_K or _DROP_LATENT:
        HookRegistry.register(
            "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req", _drop_page, HookType.BEFORE
        )
    if _HOLD:
        HookRegistry.register(
            "sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred",
            _hold_decode_transfers,
            HookType.BEFORE,
        )
    if _HOLD_PREFILL:
        HookRegistry.register(
            "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue",
            _hold_prefill_transfers,
            HookType.BEFORE,
        )
    if _CANARY:  # after the faults above on the same targets: it sees what they did
        HookRegistry.register("sglang.srt.mem_cache.allocation.alloc_for_extend", _canary_extend, HookType.AFTER)
        HookRegistry.register("sglang.srt.mem_cache.allocation.alloc_for_decode", _canary_decode, HookType.AFTER)
        HookRegistry.register(
            "sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc", _canary_prealloc, HookType.AFTER
        )
    if _LOG:
        HookRegistry.register(
            "sglang.srt.disaggregation.decode.DecodePreallocQueue._send_kv_metadata", _probe_publish, HookType.BEFORE
        )

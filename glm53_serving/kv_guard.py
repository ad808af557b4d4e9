"""The KV guard as a whole: its three parts, and the two places where they meet.

Parts (each switchable on its own with GLM53_KV_GUARD_OFF, all on by default; hooks.KV_PARTS):
- "zero"    kv_zero.py: every KV slot handed out reads zeros until its request writes it (a
            decode step's slot continuing its request's own page: zeros or that request's KV);
- "owner"   kv_owner.py: every page carries its owner, checked before every read;
- "handoff" kv_handoff.py: PD decode decodes only over the prompt length prefill sent KV for.

They meet (1) at PD decode's pre-allocation, where the destination is tagged with its owner and
the zero fills must complete before its page indices go to prefill, and (2) at start-up, where a
scheduler whose allocator a part on cannot guard refuses to start.
"""

from __future__ import annotations

import torch

from glm53_serving import kv_owner, kv_zero, plugin


def publish_prealloc(result, self, req, *args, **kwargs):
    """AFTER DecodePreallocQueue._pre_alloc: tag the destination with req's owner (if that part
    is on), then publish. The zero fills are queued on the device stream; wait for them before
    the page indices can be published to prefill, whose writes land over the network and do not
    wait for our stream (vLLM zeroed after the transfer and clobbered landed KV; this is the other
    order). CPU ops are synchronous already."""
    if plugin.kv_part_on("owner"):
        kv_owner.tag_prealloc(result, self, req)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    return result


def report_state(result, self, *args, **kwargs):
    """AFTER Scheduler.get_internal_state: the pool as the guard sees it, in /server_info's
    `internal_states` (the operator's endpoint): pages in all, free, evictable (prefix cache) and
    owned, and the requests the scheduler still holds. After a drain and a cache flush every
    page is free and none is owned (the isolation suite's drain oracle reads this)."""
    alloc = self.token_to_kv_pool_allocator
    tags = alloc.__dict__.get(kv_owner._TAGS)
    page = alloc.page_size
    waiting = []
    for name in (
        "waiting_queue",
        "disagg_prefill_bootstrap_queue",
        "disagg_prefill_inflight_queue",
        "disagg_decode_prealloc_queue",
        "disagg_decode_transfer_queue",
    ):
        queue = getattr(self, name, None)
        waiting.append(queue if isinstance(queue, list) else getattr(queue, "queue", []))
    running = getattr(self, "running_batch", None)
    # PD decode holds the pages of a request whose transfer failed until its prefill acks that
    # nothing more is written into them, or SGLang's 30 s deadline (deferred KV release): held,
    # not leaked, and no queue lists them.
    transfer = getattr(self, "disagg_decode_transfer_queue", None)
    result.internal_state["glm53_kv"] = {
        "page_size": page,
        "pages": alloc.size // page,
        "free_pages": alloc.available_size() // page,
        "evictable_pages": int(self.tree_cache.evictable_size()) // page,
        "owned_pages": None if tags is None else int(torch.count_nonzero(tags)),
        "running_requests": len(running.reqs) if running is not None else 0,
        "queued_requests": sum(len(q) for q in waiting),
        "deferred_releases": len(getattr(transfer, "_deferred_releases", None) or ()),
        # SGLang's own measure, which its cache flush waits for: also a chunked prefill, a last batch
        "idle": bool(self.is_fully_idle()),
    }
    return result


def allocator_problems(allocator) -> list[str]:
    """Why the parts switched on cannot guard this scheduler's allocator (empty: they can).
    The owner part needs the zeroing code too: a quarantined row gets fresh zeroed pages."""
    problems = []
    if plugin.kv_part_on("zero") or plugin.kv_part_on("owner"):
        problems += kv_zero.allocator_problems(allocator)
    if plugin.kv_part_on("owner"):
        problems += kv_owner.allocator_problems(allocator)
    return problems

"""KV pages are tenant data: every KV slot the allocator hands out reads as zeros.

Invariant: a KV slot returned by an allocation holds zeros in every layer buffer of the pool
(K and V, or the MLA latent buffer) until the request it was allocated for writes it. In PD,
decode's pre-allocated destination is zero before its indices are published to prefill.

Attack/incident closed: the decoder attended over KV pages that earlier requests of other
customers had left behind (a one-token stub forwarded as if prefilled; upstream, still: a fake
bootstrap host, or prefill and decode truncating to different lengths). Upstream SGLang never
clears a page on free or allocation, so any such path leaks another tenant's KV; with this guard
it reads zeros instead.

How: an AFTER hook on each allocation method of the supported allocators zeroes the returned
slots with one indexed fill per layer buffer (batched per allocation, never a loop per page).
A server whose allocator or pool this module does not know how to zero refuses to start.
Owner tags and the per-read owner check: kv_owner.py.
"""

from __future__ import annotations

import torch

from glm53_serving import kv_owner, plugin
from glm53_serving.metrics import LazyCounter

# Exact types only: a subclass may allocate through paths these hooks do not see.
SUPPORTED_ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")
# Pool layouts whose layer buffers are indexed by token slot on dim 0.
SUPPORTED_POOLS = {"MHATokenToKVPool": ("k_buffer", "v_buffer"), "MLATokenToKVPool": ("kv_buffer",)}

ZEROED = LazyCounter("glm53_kv_zeroed_slots", "KV slots zeroed before reuse")


def layer_buffers(pool) -> list[torch.Tensor]:
    names = SUPPORTED_POOLS.get(type(pool).__name__)
    if names is None:
        raise TypeError(f"kv_guard cannot zero a {type(pool).__name__}")
    bufs = []
    for name in names:
        b = getattr(pool, name)
        bufs.extend(b if isinstance(b, (list, tuple)) else [b])
    assert bufs and all(isinstance(b, torch.Tensor) for b in bufs), type(pool).__name__
    return bufs


MAX_RUNS_AS_SLICES = 4  # an allocation in at most this many contiguous runs is zeroed slice by slice
SMALL_ALLOC = 64  # slots; at most this many are always zeroed by one indexed fill per buffer


def zero_slots(pool, slots: torch.Tensor) -> None:
    """Zero `slots` (token slot ids) in every layer buffer of `pool`: per buffer, one indexed
    fill, or a few slice fills when the slots form a few contiguous runs (the common case: the
    allocator hands out ranges of its free list). Zero bytes are zero in every KV dtype, so
    rows are filled as 8-byte words where they can be."""
    if slots.numel() == 0:
        return
    # Finding runs costs a sort and a host copy: worth it for prefill-sized allocations only (and
    # never on a GPU, where it would sync); a decode step's few slots take the indexed fill.
    runs = _runs(slots) if slots.device.type == "cpu" and slots.numel() > SMALL_ALLOC else None
    for buf in layer_buffers(pool):
        rows = _as_words(buf)
        if runs is not None and len(runs) <= MAX_RUNS_AS_SLICES:
            for start, stop in runs:
                rows[start:stop].zero_()
        else:
            rows.index_fill_(0, slots, 0)
    ZEROED.inc(int(slots.numel()))


def _runs(slots: torch.Tensor) -> list[tuple[int, int]]:
    s = slots.sort().values
    cuts = torch.nonzero(s[1:] != s[:-1] + 1).flatten() + 1
    if cuts.numel() >= MAX_RUNS_AS_SLICES:
        return [None] * (MAX_RUNS_AS_SLICES + 1)  # too fragmented: use the indexed fill
    bounds = [0, *cuts.tolist(), s.numel()]
    return [(int(s[a]), int(s[b - 1]) + 1) for a, b in zip(bounds, bounds[1:])]


def _as_words(buf: torch.Tensor) -> torch.Tensor:
    """Row view of `buf` as int64 words when its rows allow it (same bytes, wider stores)."""
    if not buf.is_contiguous():
        return buf
    rows = buf.view(buf.shape[0], -1)
    if (rows.shape[1] * rows.element_size()) % 8 == 0:
        return rows.view(torch.int64)
    return rows


def zero_after_alloc(result, self, *args, **kwargs):
    """AFTER TokenToKVPoolAllocator.alloc and PagedTokenToKVPoolAllocator.alloc/alloc_extend/alloc_decode."""
    if result is not None:
        zero_slots(self.get_kvcache(), result)
    return result


def publish_after_zeroing(result, self, req, *args, **kwargs):
    """AFTER DecodePreallocQueue._pre_alloc: tag the destination with req's owner (kv_owner.py),
    then publish. The fills above are queued on the device stream;
    wait for them before the page indices can be published to prefill, whose writes land over
    the network and do not wait for our stream (vLLM zeroed after the transfer and clobbered
    landed KV; this is the other order). CPU ops are synchronous already."""
    if plugin.kv_part_on("owner"):
        kv_owner.tag_prealloc(result, self, req)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    return result


def allocator_problems(allocator) -> list[str]:
    """Why this scheduler's allocator cannot be guarded (empty: it can)."""
    name = type(allocator).__name__
    if name not in SUPPORTED_ALLOCATORS:
        return [f"kv_guard does not support the {name} allocator (supported: {', '.join(SUPPORTED_ALLOCATORS)}); "
                "serving without zero-before-reuse is refused"]
    pool = allocator.get_kvcache()
    if type(pool).__name__ not in SUPPORTED_POOLS:
        return [f"kv_guard cannot zero the {type(pool).__name__} KV pool (supported: {', '.join(SUPPORTED_POOLS)}); "
                "serving without zero-before-reuse is refused"]
    return []

"""KV guard part "zero": every KV slot the allocator hands out reads as zeros.

Invariant: a KV slot returned by an allocation holds zeros in every layer buffer of the pool
(K and V; or the MLA latent buffer, and for DSA also the indexer cache's key and scale bytes)
until the request it was allocated for writes it. In PD,
decode's pre-allocated destination is zero before its indices are published to prefill.
Paged pools: a page an allocation opens (hands out its first slot) is zeroed whole, its later
slots too; a decode step's slot continuing its request's last page is not zeroed again (that
page was zeroed whole when opened, only its own request has written it since, and the step's
forward writes the slot before reading it): it reads zeros or its own request's KV, never
anyone else's.

Attack/incident closed: the decoder attended over KV pages that earlier requests of other
customers had left behind (a one-token stub forwarded as if prefilled; upstream, still: a fake
bootstrap host, or prefill and decode truncating to different lengths). Upstream SGLang never
clears a page on free or allocation, so any such path leaks another tenant's KV; with this guard
it reads zeros instead.

How: an AFTER hook on each allocation method of the supported allocators zeroes the returned
slots with one indexed fill per layer buffer (batched per allocation, never a loop per page;
one per layer where SGLang keeps a layer's K and V as the two halves of one allocation).
A server whose allocator or pool this module does not know how to zero refuses to start.
The other parts: kv_owner.py (owner tags, checked before every read), kv_handoff.py (PD length
check); kv_guard.py joins them where they meet.
"""

from __future__ import annotations

import torch

from glm53_serving.metrics import LazyCounter

# Exact types only: a subclass may allocate through paths these hooks do not see.
SUPPORTED_ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")
# Pool layouts whose layer buffers are indexed by token slot on dim 0 (DSA's indexer cache,
# indexed by page, is zeroed by _zero_indexer).
SUPPORTED_POOLS = {
    "MHATokenToKVPool": ("k_buffer", "v_buffer"),
    "MLATokenToKVPool": ("kv_buffer",),
    "DSATokenToKVPool": ("kv_buffer",),
}

ZEROED = LazyCounter("glm53_kv_zeroed_slots", "KV slots zeroed before reuse")


def layer_buffers(pool) -> list[torch.Tensor]:
    names = SUPPORTED_POOLS.get(type(pool).__name__)
    if names is None:
        raise TypeError(f"kv_guard cannot zero a {type(pool).__name__}")
    bufs = []
    for name in names:
        b = getattr(pool, name)
        bufs.extend(b if isinstance(b, (list, tuple)) else [b])
    if not bufs or not all(isinstance(b, torch.Tensor) for b in bufs):
        raise TypeError(f"kv_guard found no KV tensors in a {type(pool).__name__}")
    return bufs


def _fill_targets(pool) -> list[tuple[torch.Tensor, int]]:
    """What zero_slots fills, as (tensor, dim of its token slots): the layer buffers, with
    an MHA layer's K and V as one target where SGLang stores them as the two halves of one
    allocation (then one fill zeroes both). Cached per pool while its buffers are the same
    objects (a pool that re-creates them, e.g. after releasing memory, is looked at again)."""
    bufs = layer_buffers(pool)
    cached = pool.__dict__.get("_glm53_fill_targets")
    if cached is not None and len(cached[0]) == len(bufs) and all(a is b for a, b in zip(cached[0], bufs)):
        return cached[1]
    if type(pool).__name__ == "MHATokenToKVPool":  # layer_buffers: k_buffer..., then v_buffer...
        half = len(bufs) // 2
        targets = []
        for k, v in zip(bufs[:half], bufs[half:]):
            if _halves_of_one(k, v):
                targets.append((_as_words(k._base, lead=1), 1))  # (2, rows, words)
            else:
                targets += [(_as_words(k), 0), (_as_words(v), 0)]
    else:
        targets = [(_as_words(buf), 0) for buf in bufs]
    pool._glm53_fill_targets = (bufs, targets)
    return targets


def _halves_of_one(k: torch.Tensor, v: torch.Tensor) -> bool:
    base = k._base
    return (
        base is not None
        and v._base is base
        and base.is_contiguous()
        and base.dim() == k.dim() + 1
        and base.shape[0] == 2
        and base.shape[2:] == k.shape[1:]
        and base.shape[1] >= k.shape[0]
        and k.data_ptr() == base[0].data_ptr()
        and v.data_ptr() == base[1].data_ptr()
    )


MAX_RUNS_AS_SLICES = 4  # an allocation in at most this many contiguous runs is zeroed slice by slice
SMALL_ALLOC = 64  # slots; at most this many are always zeroed by one indexed fill per buffer


def zero_slots(pool, slots: torch.Tensor) -> None:
    """Zero `slots` (token slot ids) in every layer buffer of `pool`: per buffer, one indexed
    fill, or a few slice fills when the slots form a few contiguous runs (the common case: the
    allocator hands out ranges of its free list). Zero bytes are zero in every KV dtype, so
    rows are filled as 16- or 8-byte words where they can be (_as_words)."""
    if slots.numel() == 0:
        return
    n = int(slots.numel())
    page = getattr(pool, "page_size", 1)
    if page > 1:
        # Paged pools (DSA: 64 tokens). A page this allocation opens (it holds the page's first
        # slot: paged pools keep slot % page == position % page) is zeroed whole, the slots the
        # request will only take at later decode steps too: nothing of the page's previous
        # owner stays in it, not even where no one reads (a PD transfer copies whole pages, so
        # a stale tail would travel to decode). Where the host has the slots (CPU; a GPU
        # prefill) as page rows (_zero_pages: long runs of adjacent pages as memsets, else one
        # indexed fill of whole page rows); the slots continuing an older page (the request's
        # own) as below.
        if slots.device.type != "cpu" and n <= WIDEN_MAX:  # a decode step's: no host sync
            slots = _with_opened_pages(slots, page)
        else:
            opened, slots = _opened_pages(slots, page)
            if opened.numel():
                _zero_pages(pool, opened, page)
            if slots.numel() == 0:
                ZEROED.inc(n)
                return
    # Finding runs costs a sort and a host copy: worth it for prefill-sized allocations only (and
    # never on a GPU, where it would sync); a decode step's few slots take the indexed fill.
    runs = _runs(slots) if slots.device.type == "cpu" and slots.numel() > SMALL_ALLOC else None
    for rows, dim in _fill_targets(pool):
        if runs is not None and len(runs) <= MAX_RUNS_AS_SLICES:
            for start, stop in runs:
                rows.narrow(dim, start, stop - start).zero_()
        else:
            rows.index_fill_(dim, slots, 0)
    if type(pool).__name__ == "DSATokenToKVPool":
        _zero_indexer(pool, slots)
    ZEROED.inc(n)


# A GPU allocation of at most this many slots (decode steps) widens opened pages into indices
# (up to page x as many) rather than sync once to find them; a prefill's syncs.
WIDEN_MAX = 1024


def _opened_pages(slots: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the pages `slots` opens, sorted; the slots on other pages): a page is opened by the
    allocation that hands out its first slot; the others continue a page the request already
    holds. Elementwise ops, a sort of the opened pages and a binary search (unique + isin took
    90 us of a 64-page allocation, 380 us when scattered)."""
    pages = torch.div(slots, page, rounding_mode="floor")  # (`//` goes through a Python wrapper)
    opens = slots == pages * page
    if not bool(opens.any()):  # most decode steps (63 in 64 at 64-token pages)
        return slots[:0], slots
    opened = pages[opens].sort().values  # distinct: an allocation's slots are
    found = opened[torch.searchsorted(opened, pages).clamp_(max=opened.numel() - 1)]
    return opened, slots[found != pages]


def _with_opened_pages(slots: torch.Tensor, page: int) -> torch.Tensor:
    """`slots`, each page-opening slot widened to its whole page (repeats are harmless to a
    zero fill): page x as many indices, built without reading anything back to the host."""
    offsets = torch.arange(page, device=slots.device)
    opens = (slots % page == 0)[:, None]
    return torch.where(opens, slots[:, None] + offsets, slots[:, None]).flatten()


# A buffer whose runs of adjacent pages average at least this many bytes is zeroed run by run
# (each run one memset, all runs of all buffers in one torch._foreach_zero_); otherwise by one
# indexed fill of its page rows as 16-byte words. Measured on this CPU (2 threads, 64 pages of
# 8 layers): index-K rows (8,448 B) in 1 run: slices 0.9-1.1x of memset, indexed 0.7-0.8x; in
# 60 runs: slices 0.05x, indexed 0.6-0.8x. Latent rows (73,728 B): runs of 4+ pages slices and
# indexed about even; single pages indexed 0.75x, slices 0.45x (a C-level fill_ per slice).
MIN_RUN_BYTES = 128 * 1024


def _zero_pages(pool, pages: torch.Tensor, page: int) -> None:
    """Zero whole pages in every layer buffer (rows page*i .. page*i+page-1) and, for DSA, the
    pages' indexer rows (keys and scales: the whole row)."""
    rows, other = _page_targets(pool, page)
    _zero_page_rows(rows, pages.to(torch.int64))
    if other:  # not laid out as whole pages: per-slot fill
        slots = (pages[:, None] * page + torch.arange(page, device=pages.device)).flatten()
        for t, dim in other:
            t.index_fill_(dim, slots, 0)


def _zero_page_rows(targets: list[torch.Tensor], pages: torch.Tensor) -> None:
    """Zero rows `pages` (sorted, int64) of each [page, words] tensor in `targets`: long runs of
    adjacent pages as slices, all of them in one C-level call; else one indexed fill per tensor."""
    runs = _page_runs(pages)
    per_run = pages.numel() / len(runs)
    slices = []
    for t in targets:
        if per_run * t.shape[1] * t.element_size() >= MIN_RUN_BYTES:
            slices += [t.narrow(0, start, stop - start) for start, stop in runs]
        else:
            t.index_fill_(0, pages, 0)
    if slices:
        torch._foreach_zero_(slices)


def _page_targets(pool, page: int) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, int]]]:
    """(each buffer laid out as whole pages, viewed [page, words]: the layer buffers' page rows,
    then for DSA each indexer layer's rows, one per page: its keys, then its scales; the fill
    targets that are not, as _fill_targets gives them). Cached as _fill_targets."""
    targets = _fill_targets(pool)
    index = [b for b in pool.index_key_cache.buffer if b.shape[0]] if type(pool).__name__ == "DSATokenToKVPool" else []
    key = [t for t, _ in targets] + index
    cached = pool.__dict__.get("_glm53_page_targets")
    if cached is not None and len(cached[0]) == len(key) and all(a is b for a, b in zip(cached[0], key)):
        return cached[1]
    rows, other = [], []
    for t, dim in targets:
        if dim == 0 and t.is_contiguous() and t.shape[0] % page == 0:
            rows.append(_as_words(t.view(t.shape[0] // page, -1)))
        else:
            other.append((t, dim))
    rows += [_as_words(b) for b in index]
    pool._glm53_page_targets = (key, (rows, other))
    return rows, other


def _page_runs(pages: torch.Tensor) -> list[tuple[int, int]]:
    """Adjacent pages as [start, stop) runs (`pages` sorted; a repeat makes two overlapping
    runs, harmless to zeroing). In Python on the host list: one copy, no per-run tensor op."""
    ids = pages.tolist()
    runs, start = [], ids[0]
    for prev, cur in zip(ids, ids[1:]):
        if cur != prev + 1:
            runs.append((start, prev + 1))
            start = cur
    runs.append((start, ids[-1] + 1))
    return runs


def index_k_parts(pool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """DSA's indexer cache, per layer that has one: (keys, scales), each viewed [page, slot in
    page, bytes], so that `[slots // page, slots % page]` addresses slots. A page's row holds its
    fp8 keys (index_head_dim bytes per slot) and then its scales (4 bytes per quant block per
    slot), IndexKeyCache.move's layout; index_problems() refuses the variants laid out otherwise.
    A layer that reuses the previous layer's top-k has no index keys (no rows)."""
    p = pool.page_size
    key_bytes = p * pool.index_head_dim
    return [
        (buf[:, :key_bytes].view(buf.shape[0], p, -1), buf[:, key_bytes:].view(buf.shape[0], p, -1))
        for buf in pool.index_key_cache.buffer
        if buf.shape[0]
    ]


def _zero_indexer(pool, slots: torch.Tensor) -> None:
    """Zero the index keys and scales of `slots` in every layer's indexer rows. As 4-byte words
    (a slot's keys and its scale are whole words: index_head_dim and 4 bytes per quant block),
    one flat index for both parts, built once and filled once per layer (two index_puts per
    layer through sliced views took a decode step's zeroing 2x as long on the CPU)."""
    words = _index_words(pool)
    p = pool.page_size
    slots = slots.to(torch.int64)  # word offsets outgrow int32 slot ids (a no-op for int64 ones)
    page, off = torch.div(slots, p, rounding_mode="floor"), torch.remainder(slots, p)
    if words is None:  # a layout that is not whole words: per part, as [page, slot] rows
        for keys, scales in index_k_parts(pool):
            keys[page, off] = 0
            scales[page, off] = 0
        return
    flats, row, in_page = words
    index = ((page * row).unsqueeze(1) + in_page[off]).flatten()
    for flat in flats:
        flat.index_fill_(0, index, 0)


def _index_words(pool) -> tuple[list[torch.Tensor], int, torch.Tensor] | None:
    """(each indexer buffer that has rows, as a flat int32 view; the words of a page row; per
    slot offset in a page, the words of its keys and its scale within the page row), or None
    when a slot's parts are not whole words. Cached per pool while its buffers are the same
    objects (as _fill_targets)."""
    bufs = [buf for buf in pool.index_key_cache.buffer if buf.shape[0]]
    cached = pool.__dict__.get("_glm53_index_words")
    if cached is not None and len(cached[0]) == len(bufs) and all(a is b for a, b in zip(cached[0], bufs)):
        return cached[1]
    p, key_bytes = pool.page_size, pool.index_head_dim
    scale_bytes = pool.index_head_dim // pool.quant_block_size * 4
    words = None
    if key_bytes % 4 == 0 and all(b.is_contiguous() and b.element_size() == 1 for b in bufs):
        kw, sw = key_bytes // 4, scale_bytes // 4
        off = torch.arange(p).unsqueeze(1)
        in_page = torch.cat((off * kw + torch.arange(kw), p * kw + off * sw + torch.arange(sw)), 1)
        device = bufs[0].device if bufs else "cpu"
        words = ([b.view(-1).view(torch.int32) for b in bufs], p * (kw + sw), in_page.to(device))
    pool._glm53_index_words = (bufs, words)
    return words


def _runs(slots: torch.Tensor) -> list[tuple[int, int]]:
    s = slots.sort().values
    cuts = torch.nonzero(s[1:] != s[:-1] + 1).flatten() + 1
    if cuts.numel() >= MAX_RUNS_AS_SLICES:
        return [None] * (MAX_RUNS_AS_SLICES + 1)  # too fragmented: use the indexed fill
    bounds = [0, *cuts.tolist(), s.numel()]
    return [(int(s[a]), int(s[b - 1]) + 1) for a, b in zip(bounds, bounds[1:])]


def _as_words(buf: torch.Tensor, lead: int = 0) -> torch.Tensor:
    """`buf` with its rows (dim `lead`) as the widest words they allow: 16 bytes (complex128; a
    zero word is all zero bits) or 8 (int64); else `buf` itself. Same bytes, fewer elements:
    an indexed fill writes element by element (on this CPU 16-byte words fill 4,096 scattered
    1,152-byte rows 6x faster than 8-byte ones)."""
    if not buf.is_contiguous():
        return buf
    rows = buf.view(*buf.shape[: lead + 1], -1)
    row_bytes = rows.shape[-1] * rows.element_size()
    # 16-byte words only where measured: a complex fill on a GPU is not (no device here).
    if row_bytes % 16 == 0 and buf.device.type == "cpu":
        return rows.view(torch.complex128)
    if row_bytes % 8 == 0:
        return rows.view(torch.int64)
    return rows


def zero_after_alloc(result, self, *args, **kwargs):
    """AFTER TokenToKVPoolAllocator.alloc and PagedTokenToKVPoolAllocator.alloc/alloc_extend."""
    if result is not None:
        zero_slots(self.get_kvcache(), result)
    return result


def zero_after_alloc_decode(result, self, seq_lens, seq_lens_cpu, *args, **kwargs):
    """AFTER PagedTokenToKVPoolAllocator.alloc_decode: zero the pages this step opens, whole.

    `seq_lens_cpu` are the lengths with the new token (alloc_decode's own argument): row i's
    new slot opens a page iff its position seq_lens_cpu[i] - 1 is a page's first (the allocator
    takes a free page exactly there). Every other slot continues the row's last page, which the
    allocation that opened it zeroed whole and which only its request has written since (the
    owner part checks before every read that the page is the request's own); the forward writes
    that slot before anything reads it. So 63 in 64 steps (64-token pages) cost one host test
    here, with no device op and no sync: on a GPU, the per-layer fills they skip are about 2
    kernel launches per layer on the scheduler's critical path."""
    if result is not None:
        opening = rows_opening_a_page(seq_lens_cpu - 1, self.page_size, result)
        if opening is not None:
            zero_slots(self.get_kvcache(), *opening)
    return result


def rows_opening_a_page(positions_cpu: torch.Tensor, page: int, *rows: torch.Tensor) -> tuple | None:
    """`rows` (tensors with one entry per batch row) kept at the rows whose new slot, at host
    position positions_cpu[i], is a page's first (the paged allocator takes a free page exactly
    there); None when no row's is (63 in 64 decode steps at 64-token pages). A host test, no
    sync; rows are selected on the device only when some open a page and others do not."""
    opens = torch.remainder(positions_cpu, page) == 0
    if not bool(opens.any()):
        return None
    if bool(opens.all()):
        return rows
    i = torch.nonzero(opens).flatten().to(rows[0].device)
    return tuple(t[i] for t in rows)


def allocator_problems(allocator) -> list[str]:
    """Why this scheduler's allocator cannot be guarded (empty: it can)."""
    name = type(allocator).__name__
    if name not in SUPPORTED_ALLOCATORS:
        return [
            f"kv_guard does not support the {name} allocator (supported: {', '.join(SUPPORTED_ALLOCATORS)}); "
            "serving without zero-before-reuse is refused"
        ]
    pool = allocator.get_kvcache()
    if type(pool).__name__ not in SUPPORTED_POOLS:
        return [
            f"kv_guard cannot zero the {type(pool).__name__} KV pool (supported: {', '.join(SUPPORTED_POOLS)}); "
            "serving without zero-before-reuse is refused"
        ]
    # zero_slots indexes rows by token slot: a layout that leads with pages (SGLANG_USE_HND_KVCACHE,
    # AITER's vectorized_5d) would zero other rows, and a quantized pool keeps per-slot scales
    # in buffers this module does not know.
    slots = pool.size + pool.page_size
    if getattr(pool, "is_quantized_kv_cache", False):
        return [
            f"kv_guard cannot zero a quantized {type(pool).__name__} (scale buffers); "
            "serving without zero-before-reuse is refused"
        ]
    bad = sorted({tuple(b.shape) for b in layer_buffers(pool) if b.shape[0] != slots})
    if bad:
        return [
            f"kv_guard needs KV buffers indexed by token slot ({slots} rows; layout "
            f"{getattr(pool, 'kv_cache_layout', '?')!r} has shapes {bad}); serving without zero-before-reuse is refused"
        ]
    return index_problems(pool) if type(pool).__name__ == "DSATokenToKVPool" else []


def index_problems(pool) -> list[str]:
    """Why _zero_indexer cannot zero this DSA pool's indexer cache (empty: it can)."""
    from sglang.srt.mem_cache import index_key_cache

    p, refuse = pool.page_size, "; serving without zero-before-reuse is refused"
    if index_key_cache._use_aiter_preshuffle or pool.index_kpool != 1 or pool.index_page_size != p:
        return [
            f"kv_guard zeroes the DSA indexer cache in its plain layout only (index_kpool "
            f"{pool.index_kpool}, index page {pool.index_page_size} of {p}, AITER preshuffle "
            f"{index_key_cache._use_aiter_preshuffle})" + refuse
        ]
    row = p * (pool.index_head_dim + pool.index_head_dim // pool.quant_block_size * 4)
    pages = (pool.size + p) // p
    bad = sorted(
        {
            tuple(b.shape)
            for b in pool.index_key_cache.buffer
            if b.shape[0] and (b.shape[0] < pages or b.shape[1] != row or not b.is_contiguous())
        }
    )
    if bad:
        return [f"kv_guard expects DSA indexer rows of {row} bytes for {pages} pages, found {bad}" + refuse]
    return []

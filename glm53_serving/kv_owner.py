"""KV pages carry their owner; a request reads only pages of its own cache namespace.

Invariant: every KV page (token slot when page_size is 1) has an owner tag on the pool's
device: the cache namespace of the request it was last allocated for, or 0 while free. Before a
forward pass reads a request's KV (extend and decode batch build; in PD decode the first decode
step after the transfer is such a batch build), every slot of the request's `req_to_token` row
in [0, seq_len) must be tagged with the request's namespace. A request failing the check is
aborted alone (HTTP 500 `kv_isolation_violation`, nothing returned), its row is redirected to
slots it may read (see `quarantine`), so that the forward it still rides reads nothing foreign,
and it is never inserted into the prefix cache.

Attack/incident closed: the decoder attended over KV that other tenants' requests had left (a
stale or foreign index in a request's row). Zeroing (kv_zero.py) makes *free* pages harmless;
this makes a *live* page of another namespace unreadable, whatever put its index in the row.

Owner id: the request's cache namespace, `(req.cache_salt, req.extra_key)`, hashed to a stable
non-zero 63-bit id (both None: `DEFAULT_NAMESPACE`). The radix key carries the same pair, so a
prefix shared through the cache stays owned by the namespace that wrote it and is readable only
within that namespace; the tenants work sets `cache_salt` from the authenticated tenant, which
makes owner == tenant.

How (hooks.py, part "owner"):
- tags are set where the scheduler allocates for known requests: AFTER `alloc_for_extend`,
  AFTER `alloc_for_decode` (both then run the check on the whole batch), AFTER
  `DecodePreallocQueue._pre_alloc` (PD decode destination); a paged decode step claims only the
  slots that open a page: a slot continuing the row's last page must find it already the
  request's, or the check flags it (a stale last position pointing into a free page too);
- tags go back to 0 where pages go back to the free list: `TokenToKVPoolAllocator.free`,
  `PagedTokenToKVPoolAllocator._release_page_ids` (the paged choke point) and both `clear`s;
- a claim only takes pages that are free (tag 0): a page continuing a row (the partial last
  page of a paged prefix) keeps its owner, so a foreign page is never re-labelled, only caught;
- the check is one gather and compare over the batch's rows (no Python loop per page); only a
  violation, which should never happen, takes the slow path.
"""

from __future__ import annotations

import hashlib
import logging
from http import HTTPStatus

import torch

from glm53_serving import events, kv_zero
from glm53_serving.errors import KV_ISOLATION_MESSAGE
from glm53_serving.metrics import KV_VIOLATIONS, LazyCounter

logger = logging.getLogger("glm53_serving")

DEFAULT_NAMESPACE = 1  # (cache_salt, extra_key) == (None, None)
FREE = 0
VIOLATION_CODE = "kv_isolation_violation"  # FINISH_ABORT.err_type; http_guard maps it to the contract

CHECKED = LazyCounter("glm53_kv_owner_checked_requests", "Request rows owner-checked before a forward pass")
VIOLATIONS = KV_VIOLATIONS
QUARANTINED = LazyCounter("glm53_kv_quarantined_slots", "Row positions redirected after an isolation violation")

_TAGS = "_glm53_owner_tags"


# --- owner ids ------------------------------------------------------------------------------


def namespace_id(cache_salt, extra_key) -> int:
    """Stable non-zero 63-bit id of a cache namespace (the same pair the radix key uses)."""
    if cache_salt is None and extra_key is None:
        return DEFAULT_NAMESPACE
    digest = hashlib.blake2b(repr((cache_salt, extra_key)).encode(), digest_size=8, person=b"glm53-kv-owner").digest()
    ns = int.from_bytes(digest, "little") & ((1 << 63) - 1)
    return ns if ns > DEFAULT_NAMESPACE else ns + 2  # 0 is "free", 1 the default namespace


def owner_of(req) -> int:
    return namespace_id(req.cache_salt, req.extra_key)


def _cached_owner(req) -> int:
    """owner_of(req), computed once per request (the batch builds of every decode step ask)."""
    ns = req.__dict__.get("_glm53_owner")
    if ns is None:
        ns = req._glm53_owner = owner_of(req)
    return ns


# --- the tag table --------------------------------------------------------------------------


def tags_of(allocator) -> torch.Tensor:
    """The allocator's owner tags, one int64 per page (index 0: the padding page), created free."""
    tags = allocator.__dict__.get(_TAGS)
    if tags is None:
        num_pages = allocator.size // allocator.page_size
        tags = torch.zeros(num_pages + 1, dtype=torch.int64, device=allocator.device)
        setattr(allocator, _TAGS, tags)
    return tags


def claim(allocator, slots: torch.Tensor, owners: torch.Tensor) -> None:
    """Tag the pages of `slots` (token slot ids) with `owners` (one per slot) where they are free."""
    if slots.numel() == 0:
        return
    tags = tags_of(allocator)
    pages = _pages(slots, allocator.page_size)
    current = tags.index_select(0, pages)
    tags[pages] = torch.where(current == FREE, owners, current)


def _pages(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    # (int32 slot ids index as they are; at page size 1 a slot is its page: no division op;
    # torch.div, not `//`, which goes through a Python wrapper on every call)
    return slots if page_size == 1 else torch.div(slots, page_size, rounding_mode="floor")


def release(allocator, pages: torch.Tensor) -> None:
    tags = allocator.__dict__.get(_TAGS)
    if tags is not None and pages.numel():
        tags[pages] = FREE


def foreign(
    allocator, req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, max_len: int, owners: torch.Tensor
) -> torch.Tensor:
    """(batch, max_len) bool: positions < len whose page is not tagged with the row's owner.

    Positions at or beyond a row's length are masked out before anything depends on them:
    stale indices left in a reused row are never read (clamped only to keep the gather in range)."""
    tags = tags_of(allocator)
    # (index_select and a cached arange: the same values as advanced indexing and a fresh
    # arange, in fewer and cheaper ops; this runs at every batch build)
    slots = req_to_token[:, :max_len].index_select(0, rows).clamp_(0, tags.numel() * allocator.page_size - 1)
    pages = _pages(slots, allocator.page_size)
    page_tags = tags.index_select(0, pages.flatten()).view(pages.shape)
    live = _positions(max_len, slots.device).unsqueeze(0) < lens.unsqueeze(1)
    return live & (page_tags != owners.unsqueeze(1))


_POSITIONS: dict[torch.device, torch.Tensor] = {}


def _positions(n: int, device: torch.device) -> torch.Tensor:
    """arange(n) on `device`, sliced from one kept per device (grown when a longer one is asked)."""
    cached = _POSITIONS.get(device)
    if cached is None or cached.numel() < n:
        cached = _POSITIONS[device] = torch.arange(max(n, 4096), device=device)
    return cached[:n]


# --- hooks ----------------------------------------------------------------------------------


def _owners(reqs, device) -> torch.Tensor:
    return torch.tensor([_cached_owner(r) for r in reqs], dtype=torch.int64).to(device, non_blocking=True)


def _allocator(batch):
    return batch.tree_cache.token_to_kv_pool_allocator


def tag_and_check_extend(result, batch, *args, **kwargs):
    """AFTER mem_cache.allocation.alloc_for_extend: claim the new slots, then check every row."""
    out_cache_loc, rows, _rows_cpu = result
    if not batch.reqs:
        return result
    allocator = _allocator(batch)
    owners = _owners(batch.reqs, out_cache_loc.device)
    extend_lens = torch.tensor(batch.extend_lens, dtype=torch.int64)
    claim(
        allocator,
        out_cache_loc,
        torch.repeat_interleave(owners, extend_lens.to(owners.device), output_size=out_cache_loc.numel()),
    )
    new = _Fresh(starts=batch.prefix_lens, slots=out_cache_loc, offsets=_offsets(extend_lens))
    check_batch(batch, rows, batch.seq_lens, int(batch.seq_lens_cpu.max()), owners, new, where="extend")
    return result


def tag_and_check_decode(result, batch, token_per_req, *args, **kwargs):
    """AFTER mem_cache.allocation.alloc_for_decode: claim each request's new slot(s), check every row
    up to and including them (seq_lens is incremented after this call)."""
    out_cache_loc = result
    if not batch.reqs:
        return result
    allocator = _allocator(batch)
    owners = _owners(batch.reqs, out_cache_loc.device)
    p = allocator.page_size
    if token_per_req == 1 and p > 1:
        # Only a slot opening a page (its position seq_len a page's first) takes a free page;
        # the others continue the row's last page, already the request's: left untagged here,
        # so the check below flags one that is not (a free page too: a stale last position),
        # and 63 in 64 steps cost one host test instead of a claim.
        opening = kv_zero.rows_opening_a_page(batch.seq_lens_cpu, p, out_cache_loc, owners)
        if opening is not None:
            claim(allocator, *opening)
    else:
        claim(allocator, out_cache_loc, owners if token_per_req == 1 else owners.repeat_interleave(token_per_req))
    new = _Fresh(starts=batch.seq_lens_cpu, slots=out_cache_loc, offsets=range(0, 1 << 62, token_per_req))
    check_batch(
        batch,
        batch.req_pool_indices,
        batch.seq_lens + token_per_req,
        int(batch.seq_lens_cpu.max()) + token_per_req,
        owners,
        new,
        where="decode",
    )
    return result


def _offsets(lens: torch.Tensor) -> list[int]:
    return [0, *torch.cumsum(lens, 0).tolist()]


class _Fresh:
    """The slots this batch build just allocated: request i's row positions [starts[i], ...) hold
    slots[offsets[i]:offsets[i+1]]. Only read on a violation."""

    def __init__(self, starts, slots, offsets):
        self.starts, self.slots, self.offsets = starts, slots, offsets

    def of(self, i: int) -> tuple[int, torch.Tensor]:
        return int(self.starts[i]), self.slots[self.offsets[i] : self.offsets[i + 1]]


def tag_prealloc(kv_loc, queue, req, *args, **kwargs):
    """PD decode, AFTER DecodePreallocQueue._pre_alloc: the transfer destination belongs to req."""
    if kv_loc is not None and not getattr(queue.scheduler, "enable_hisparse", False):
        owners = torch.full((kv_loc.numel(),), owner_of(req), dtype=torch.int64, device=kv_loc.device)
        claim(queue.token_to_kv_pool_allocator, kv_loc, owners)
    return kv_loc


def reset_after_free(result, self, free_index, *args, **kwargs):
    """AFTER TokenToKVPoolAllocator.free (page size 1: slot ids are page ids)."""
    release(self, free_index)
    return result


def reset_after_release(result, self, *page_ids, **kwargs):
    """AFTER PagedTokenToKVPoolAllocator._release_page_ids (every paged free ends here)."""
    for ids in page_ids:
        release(self, ids)
    return result


def reset_after_clear(result, self, *args, **kwargs):
    """AFTER the allocators' clear(): every page is free again."""
    tags = self.__dict__.get(_TAGS)
    if tags is not None:
        tags.zero_()
    return result


# --- the check and what a violation does -----------------------------------------------------


def check_batch(
    batch, rows: torch.Tensor, lens: torch.Tensor, max_len: int, owners: torch.Tensor, new: _Fresh, *, where: str
):
    if max_len <= 0:
        return
    allocator = _allocator(batch)
    bad = foreign(allocator, batch.req_to_token_pool.req_to_token, rows, lens, max_len, owners)
    CHECKED.inc(len(batch.reqs))
    if not bool(bad.any()):  # the one host sync; only a violation goes further
        return
    for i in torch.nonzero(bad.any(dim=1)).flatten().tolist():
        if batch.reqs[i].__dict__.get("_glm53_quarantined"):
            # Already aborted and its row made safe; the overlap scheduler builds one more batch
            # before the abort is processed. Its new slot is fresh; repairing again would only
            # displace (leak) the slots the first repair kept.
            continue
        quarantine(batch, batch.reqs[i], int(rows[i]), torch.nonzero(bad[i]).flatten(), *new.of(i), where=where)


def quarantine(
    batch, req, row: int, positions: torch.Tensor, new_start: int, new_slots: torch.Tensor, *, where: str
) -> None:
    """Abort `req` alone and make its row safe to read and to free.

    The forward this batch is about to run still carries the request (SGLang's "abort method
    3"), so no position of its row may reach another owner's KV when it runs, and the row must
    free exactly what the request holds afterwards (SGLang stops on a leaked or doubly freed page):
    - positions this very allocation filled get back the slot the allocator gave them (zeroed at
      allocation: whatever its tag says, it holds nothing of anyone's, and it is freed with the
      request), unless the slot continues an older page (paged), which counts as older;
    - older positions the request frees itself (>= cache_protected_len) get a fresh zeroed page
      of its own, freed with it;
    - positions of the protected prefix, which the request never frees, read the padding page 0;
    - a fresh slot on another owner's page (the allocation itself put two owners on one page)
      is replaced by the slot its own page has at that offset, or its logical page redirected
      as above, in the row and in what the forward writes (`new_slots`: out_cache_loc).
    The displaced indices are not freed: they are another owner's or cannot be trusted.
    Its outcome: 500 kv_isolation_violation, no tokens, no prefix-cache insert."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    allocator = _allocator(batch)
    p = allocator.page_size
    r2t = batch.req_to_token_pool.req_to_token
    ns = owner_of(req)
    slots = r2t[row, positions].to(torch.int64)
    tags = tags_of(allocator)
    logger.error(
        "glm53_serving KV isolation violation (%s): request %s of namespace %d would read %d slot(s) it does "
        "not own: positions %s, slots %s, pages %s, owners %s. Aborting this request only.",
        where,
        req.rid,
        ns,
        positions.numel(),
        positions[:16].tolist(),
        slots[:16].tolist(),
        (slots[:16] // p).tolist(),
        tags[slots[:16] // p].tolist(),
    )
    VIOLATIONS.inc(where=where)
    QUARANTINED.inc(int(positions.numel()))
    events.record("kv_isolation_violation", rid=req.rid, where=where, namespace=ns, slots=int(positions.numel()))

    pos = positions.tolist()
    fresh_end = new_start + new_slots.numel()
    lost = set()  # logical pages of fresh positions with no slot of their own to go back to
    for q in pos:
        if new_start <= q < fresh_end:
            slot = int(new_slots[q - new_start])
            if int(tags[slot // p]) not in (ns, FREE):
                # The allocation itself handed out a slot of another owner's page (two owners on
                # one page: claim() kept the page's owner). Neither read nor write it, nor free
                # that page with this request: the slot at q's offset in the page the
                # allocator gave q's neighbours is the one meant for q (paged pools keep
                # slot % page == position % page).
                own = _own_slot(q, new_start, new_slots, p, tags, ns)
                if own is None:
                    lost.add(q // p)
                    continue
                new_slots[q - new_start] = slot = own  # out_cache_loc: where the forward writes
            r2t[row, q] = slot
    # What is still foreign (older positions, or a fresh slot continuing a foreign page) is
    # redirected a whole page at a time: paged kernels read a logical page as one physical page.
    n = int(positions.max()) + 1
    still = foreign(
        allocator,
        r2t,
        torch.tensor([row], device=r2t.device),
        torch.tensor([n], device=r2t.device),
        n,
        torch.tensor([ns], device=r2t.device),
    )[0]
    # A position on a page this allocation took from the free list holds the allocator's own
    # slot again: zeroed at allocation, freed with the request, readable whatever its tag says.
    fresh_from = new_start + (-new_start) % p  # first page boundary inside the new positions
    fresh_to = new_start + new_slots.numel()
    pages = sorted({q // p for q in torch.nonzero(still).flatten().tolist() if not fresh_from <= q < fresh_to} | lost)
    protected = int(getattr(req.kv, "cache_protected_len", None) or 0)
    for lp in (lp for lp in pages if lp * p < protected):
        r2t[row, lp * p : lp * p + p] = torch.arange(p, dtype=r2t.dtype, device=r2t.device)
    own_pages = [lp for lp in pages if lp * p >= protected]
    if own_pages:
        _redirect_to_fresh(batch, req, row, own_pages, ns)
    redirected = set(pages)
    for q in range(new_start, fresh_end):  # what the forward writes follows the repaired row
        if q // p in redirected:
            new_slots[q - new_start] = r2t[row, q]

    message = (
        f"{KV_ISOLATION_MESSAGE} this request's KV cache row referenced pages of another owner; "
        "it was aborted before any of its output was returned."
    )
    req._glm53_quarantined = True
    req.skip_radix_cache_insert = True
    req.to_finish = FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR, VIOLATION_CODE)
    _tell_decode(req, message)


def _own_slot(q: int, new_start: int, new_slots: torch.Tensor, p: int, tags: torch.Tensor, ns: int) -> int | None:
    """The slot at q's offset of the page this allocation gave q's logical page, taken from a
    neighbour on that page that is tagged ns; None when no neighbour is."""
    lo, hi = max(new_start, q - q % p), min(new_start + new_slots.numel(), q - q % p + p)
    for s in new_slots[lo - new_start : hi - new_start].tolist():
        if int(tags[s // p]) == ns:
            return s // p * p + q % p
    return None


def _tell_decode(req, message: str) -> None:
    """PD prefill: fail the request's transfer towards decode now. Upstream's abort of a prefill
    request only marks the room failed locally, and decode (its pages pre-allocated, the client
    waiting) would wait for a transfer that never comes until its own timeout (300 s)."""
    sender = getattr(req, "disagg_kv_sender", None)
    if sender is None or getattr(req, "bootstrap_room", None) is None:
        return
    try:
        sender.kv_mgr.conclude_failure(bootstrap_room=req.bootstrap_room, failure_reason=message)
    except Exception:  # noqa: BLE001 - decode then times out: slow, but nothing is read or returned
        logger.exception("glm53_serving: could not tell decode that request %s failed the KV owner check", req.rid)


def _redirect_to_fresh(batch, req, row: int, logical_pages: list[int], ns: int) -> None:
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    allocator = _allocator(batch)
    p = allocator.page_size
    need = len(logical_pages) * p
    evict_from_tree_cache(batch.tree_cache, need)
    fresh = allocator.alloc(need)
    if fresh is None:  # fail closed: no way to run the batch without the foreign read
        raise RuntimeError(
            f"glm53_serving: no KV pages left to quarantine request {req.rid}; refusing to "
            "run a forward that would read another owner's KV"
        )
    kv_zero.zero_slots(allocator.get_kvcache(), fresh)  # zero even with the "zero" part off
    claim(allocator, fresh, torch.full((need,), ns, dtype=torch.int64, device=fresh.device))
    r2t = batch.req_to_token_pool.req_to_token
    for k, lp in enumerate(logical_pages):
        r2t[row, lp * p : lp * p + p] = fresh[k * p : k * p + p].to(r2t.dtype)


def allocator_problems(allocator) -> list[str]:
    """Why owner tags cannot be kept for this scheduler (empty: they can). Creates the tags."""
    from sglang.srt.managers import schedule_batch
    from sglang.srt.mem_cache import allocation

    problems = []
    for name in ("alloc_for_extend", "alloc_for_decode"):
        # schedule_batch calls its own `from ... import` binding: it must be the hooked function
        if getattr(schedule_batch, name) is not getattr(allocation, name):
            problems.append(f"ScheduleBatch calls an unhooked {name}: KV owner tags would not be set")
    try:
        tags = tags_of(allocator)
        if tags.dtype != torch.int64 or tags.numel() != allocator.size // allocator.page_size + 1:
            raise ValueError(
                f"tags {tuple(tags.shape)} {tags.dtype} for {allocator.size} slots of page {allocator.page_size}"
            )
    except Exception as e:  # noqa: BLE001 - any failure means no tags
        problems.append(f"cannot keep KV owner tags for {type(allocator).__name__}: {type(e).__name__}: {e}")
    return problems

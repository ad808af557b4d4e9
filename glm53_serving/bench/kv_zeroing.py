"""Cost of the KV guard against upstream, in one run, on this machine's real SGLang pools.

    python -m glm53_serving.bench.kv_zeroing [--layers 16] [--slots 65536] [--alloc 4096]
    python -m glm53_serving.bench.kv_zeroing --dsa [--layers 8]     # GLM-5.3's paged DSA pool
    python -m glm53_serving.bench.kv_zeroing --dsa --cold           # caches swept before every call

With `--dsa` the pool has GLM-5.3's 78 layers and 16,384 slots unless `--layers`/`--slots` say
otherwise: the per-layer host ops are paid once per layer buffer whatever the layer count, so
a pool of fewer layers measures them against less memory than the model zeroes.

Prints (1) zeroing bandwidth of kv_zero's batched fill vs. torch.zero_ on a contiguous buffer of
the same byte size (the memset limit), (2) allocator operations per second upstream, with
zeroing, and with zeroing + owner tags (claim on alloc, reset on free), for a prefill-sized
allocation and a decode step (1 slot), and (3) the owner check's cost per batch build (one
gather + compare over every row position the batch will read). End-to-end tokens/s with the
guards on vs. off: `python -m glm53_serving.bench.serving kv_guard`.

`--cold` writes twice the last-level cache before every timed call, of every variant and
baseline alike (bench.caches), and times that one call: memory bandwidth, as in a server, where
neither a page handed out nor anything near it is cache-resident. Without it the calls run back
to back and the baseline memset of a few MiB runs out of cache.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import torch  # noqa: E402

from glm53_serving import kv_owner, kv_zero, model  # noqa: E402
from glm53_serving.bench import caches, pools  # noqa: E402


def best_of(fn, repeat: int, inner: int, sweep=None) -> float:
    """Seconds per call, best of `repeat` timings of `inner` calls; with `sweep`, of single
    calls each after a cache sweep (not timed)."""
    return interleaved({"fn": fn}, repeat, inner, sweep)["fn"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, help="default 16; with --dsa GLM-5.3's 78")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--slots", type=int, help="default 65536; with --dsa 16384 (the pool fits in memory)")
    p.add_argument("--alloc", type=int, default=4096, help="slots per prefill-sized allocation")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--dsa", action="store_true", help="GLM-5.3's DSA pool (64-token pages, latent + index-K)")
    p.add_argument("--cold", action="store_true", help="sweep the caches before every timed call")
    a = p.parse_args(argv)
    if a.layers is None:
        a.layers = model.SHAPE["num_hidden_layers"] if a.dsa else 16
    if a.slots is None:
        a.slots = 16384 if a.dsa else 65536
    dtype = getattr(torch, a.dtype)
    sweep = None
    if a.cold:
        sweep, nbytes = caches.sweeper()
        print(f"cold: {nbytes / 2**20:.0f} MiB written before every timed call")
    if a.dsa:
        return dsa_pages(a, dtype, sweep)

    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(a.slots, 1, dtype, a.heads, a.head_dim, a.layers, "cpu", False)
    alloc = TokenToKVPoolAllocator(a.slots, dtype, "cpu", pool, False)
    bufs = kv_zero.layer_buffers(pool)
    slot_bytes = sum(b[0].numel() * b.element_size() for b in bufs)
    print(
        f"pool: {a.layers} layers x K,V x {a.heads} heads x {a.head_dim} ({a.dtype}), {a.slots} slots, "
        f"{slot_bytes} B/slot, {slot_bytes * a.slots / 2**30:.2f} GiB; torch threads {torch.get_num_threads()}"
    )

    # (1) bandwidth against memset on a buffer of the same size (touched first: no page faults)
    nbytes = slot_bytes * a.alloc
    flat = torch.zeros(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype)
    t_memset = best_of(flat.zero_, 5, 5, sweep)
    cases = {
        "contiguous run (fresh free list)": torch.arange(1, a.alloc + 1, dtype=torch.int64),
        "scattered (after churn, worst case)": torch.randperm(a.slots, dtype=torch.int64)[: a.alloc] + 1,
    }
    print(f"torch.zero_ on {nbytes / 2**20:.1f} MiB: {nbytes / t_memset / 1e9:.2f} GB/s (the memset limit)")
    for label, idx in cases.items():
        t_zero = best_of(lambda: kv_zero.zero_slots(pool, idx), 5, 5, sweep)
        print(
            f"zeroing {a.alloc} slots, {label}: {nbytes / t_zero / 1e9:.2f} GB/s -> {t_memset / t_zero:.2f}x of memset"
        )

    # (2) allocator ops/s: upstream, + zeroing, + zeroing and owner tags; same allocator
    owner = kv_owner.namespace_id("bench-tenant", None)

    def cycle(n, zero, tags):
        owners = torch.full((n,), owner, dtype=torch.int64)

        def run():
            got = alloc.alloc(n)
            if zero:
                kv_zero.zero_after_alloc(got, alloc, n)
            if tags:
                kv_owner.claim(alloc, got, owners)
            alloc.free(got)
            if tags:
                kv_owner.reset_after_free(None, alloc, got)

        return run

    for label, n, inner in (("prefill-sized alloc+free", a.alloc, 20), ("decode step alloc+free (1 slot)", 1, 2000)):
        up = best_of(cycle(n, False, False), 5, inner)
        zero = best_of(cycle(n, True, False), 5, inner)
        tagged = best_of(cycle(n, True, True), 5, inner)
        print(
            f"{label}: upstream {1 / up:,.0f} ops/s, +zeroing {1 / zero:,.0f} ops/s ({up / zero:.3f}x, "
            f"+{(zero - up) * 1e6:.1f} us), +zeroing+tags {1 / tagged:,.0f} ops/s ({up / tagged:.3f}x, "
            f"tags +{(tagged - zero) * 1e6:.1f} us per op)"
        )

    # (3) the owner check per batch build: rows of every request, all positions < length
    for bs, length in ((8, 2048), (64, 256), (8, 160)):
        lens = torch.full((bs,), length, dtype=torch.int64)
        r2t = torch.zeros(bs + 1, length, dtype=torch.int32)
        got = alloc.alloc(bs * length)
        kv_owner.claim(alloc, got, torch.full_like(got, owner))
        r2t[1:] = got.view(bs, length).to(torch.int32)
        rows, owners = torch.arange(1, bs + 1), torch.full((bs,), owner, dtype=torch.int64)
        t = best_of(lambda: bool(kv_owner.foreign(alloc, r2t, rows, lens, length, owners).any()), 5, 20)
        assert not kv_owner.foreign(alloc, r2t, rows, lens, length, owners).any()
        print(
            f"owner check, batch {bs} x {length} positions: {t * 1e6:.1f} us per batch build "
            f"({t * 1e9 / (bs * length):.2f} ns per position)"
        )
        alloc.free(got)
        kv_owner.reset_after_free(None, alloc, got)


def interleaved(fns: dict, repeat: int, inner: int, sweep=None) -> dict:
    """Seconds per call of each function, best of `repeat` rounds of `inner` calls, the
    functions taking turns within each round (a machine whose load drifts shifts them alike).
    With `sweep`: best of `repeat * inner` single calls per function, each timed alone right
    after a cache sweep."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            if sweep is not None:
                for _ in range(inner):
                    sweep()
                    t0 = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - t0)
                continue
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / inner)
    return best


def dsa_pages(a, dtype, sweep=None) -> None:
    """Zeroing whole 64-token pages of SGLang's DSATokenToKVPool with GLM-5.3's row sizes (MLA
    latent 512 + rope 64 per token per layer; index-K 128 fp8 bytes + a 4-byte scale per token)
    against torch.zero_ of the same bytes, page by page (kv_zero._zero_pages) and slot by slot
    (the indexed fill used for partly covered pages). Two baselines: torch.zero_ of one
    contiguous buffer of the same byte count ("memset"), and torch.zero_ of exactly the zeroed
    bytes in the pool's own per-layer buffers, one call per buffer and run of adjacent pages
    ("in place": what separate per-layer allocations allow a plain memset)."""
    page = pools.PAGE
    pool = pools.dsa_pool(a.slots, a.layers, model.SHAPE, dtype)
    latent = [rows for rows, _ in kv_zero._fill_targets(pool)]
    index = [b for b in pool.index_key_cache.buffer if b.shape[0]]
    for b in (*latent, *index):
        b.fill_(1)  # touched: no page faults in the timings
    latent_rows = [kv_zero._as_words(r.view(r.shape[0] // page, -1)) for r in latent]
    index_rows = [kv_zero._as_words(b) for b in index]
    n_pages = a.alloc // page
    latent_bytes = sum(r[0].numel() * r.element_size() for r in latent) * n_pages * page
    index_bytes = sum(b[0].numel() for b in index) * n_pages
    print(
        f"DSA pool: {a.layers} layers, page {page}, {a.slots} slots; an allocation of {n_pages} pages: "
        f"latent {latent_bytes / 2**20:.1f} MiB + index-K {index_bytes / 2**20:.2f} MiB; torch threads "
        f"{torch.get_num_threads()}"
    )
    flat = torch.ones(latent_bytes + index_bytes, dtype=torch.uint8)

    def in_place(targets, runs):
        def run():
            for t in targets:
                for start, stop in runs:
                    t.narrow(0, start, stop - start).zero_()

        return run

    total_pages = a.slots // page
    cases = {
        "adjacent pages (fresh free list)": torch.arange(1, n_pages + 1),
        "scattered pages (after churn)": (torch.randperm(total_pages - 1)[:n_pages] + 1).sort().values,
    }
    for label, pages in cases.items():
        slots = (pages[:, None] * page + torch.arange(page)).flatten()
        runs = kv_zero._page_runs(pages)

        def slot_by_slot(slots=slots):
            for rows in latent:
                rows.index_fill_(0, slots, 0)
            kv_zero._zero_indexer(pool, slots)

        t = interleaved(
            {
                "all": lambda slots=slots: kv_zero.zero_slots(pool, slots),
                "lat": lambda pages=pages: kv_zero._zero_page_rows(latent_rows, pages),
                "idx": lambda pages=pages: kv_zero._zero_page_rows(index_rows, pages),
                "slot": slot_by_slot,
                "m_all": flat.zero_,
                "m_lat": flat[:latent_bytes].zero_,
                "m_idx": flat[:index_bytes].zero_,
                "p_all": in_place(latent_rows + index_rows, runs),
                "p_lat": in_place(latent_rows, runs),
                "p_idx": in_place(index_rows, runs),
            },
            15,
            3,
            sweep,
        )
        print(
            f"{label} ({len(runs)} runs): zero_slots {t['m_all'] / t['all']:.2f}x of memset "
            f"({(latent_bytes + index_bytes) / t['all'] / 1e9:.2f} GB/s); latent pages {t['m_lat'] / t['lat']:.2f}x, "
            f"index-K pages {t['m_idx'] / t['idx']:.2f}x; vs zero_ in place: zero_slots {t['p_all'] / t['all']:.2f}x, "
            f"latent {t['p_lat'] / t['lat']:.2f}x, index-K {t['p_idx'] / t['idx']:.2f}x (in place vs memset "
            f"{t['m_all'] / t['p_all']:.2f}x, latent {t['m_lat'] / t['p_lat']:.2f}x, index-K "
            f"{t['m_idx'] / t['p_idx']:.2f}x); slot by slot {t['m_all'] / t['slot']:.2f}x (page zeroing "
            f"{t['slot'] / t['all']:.1f}x faster)"
        )


if __name__ == "__main__":
    main()

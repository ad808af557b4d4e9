"""The KV guard's cost per decode step, on SGLang's real batch objects, guard on vs. upstream.

    python -m glm53_serving.bench.decode_step               # 8 rows, 128-token prompts, glm53-tiny's pool
    python -m glm53_serving.bench.decode_step --rows 32 --cold

What a GPU scheduler pays on its critical path every step: `ScheduleBatch.prepare_for_decode`
(SGLang's `alloc_for_decode`, the paged allocator's `alloc_decode`) over a real ReqToTokenPool,
paged allocator and DSATokenToKVPool (64-token pages, glm53-tiny's rows), timed per call, first
upstream and then with the plugin's "zero" and "owner" rows applied by SGLang's own
HookRegistry, as in a server. `--cold` writes twice the last-level cache between steps
(bench.caches), as a forward pass does in a server: the guard's ~20 small tensor ops then run
out of cold caches (py-spy puts the guard's share of a real scheduler at 2-3x its hot cost here).
µs per step, median and p90. Not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from array import array
from types import SimpleNamespace

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import torch  # noqa: E402

from glm53_serving import hooks  # noqa: E402
from glm53_serving.bench import caches, pools  # noqa: E402
from glm53_serving.models import dsa_tiny  # noqa: E402

PAGE = pools.PAGE


def steps(a, sweep) -> list[float]:
    """µs per prepare_for_decode of one batch of a.rows requests, a.steps steps, on fresh memory."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    size = a.rows * (a.prompt + a.steps + 2 * PAGE)
    size -= size % PAGE
    pool = pools.dsa_pool(size, a.layers, dsa_tiny.CONFIG, torch.float32)
    allocator = PagedTokenToKVPoolAllocator(size, PAGE, torch.float32, "cpu", pool, False)
    rows = ReqToTokenPool(a.rows + 1, a.prompt + a.steps + 1, "cpu", False)
    tree = RadixCache(
        CacheInitParams(disable=True, req_to_token_pool=rows, token_to_kv_pool_allocator=allocator, page_size=PAGE)
    )
    reqs = []
    for i in range(a.rows):  # two tenants, as the tenant guard's cache_salt sets them
        r = Req(f"r{i}", "", array("q", [5 + i] * a.prompt), SamplingParams(), cache_salt=f"tenant-{i % 2}")
        r.init_next_round_input(tree)
        r.extend_end = a.prompt
        reqs.append(r)
    model = SimpleNamespace(vocab_size=512, is_encoder_decoder=False)
    batch = ScheduleBatch.init_new(reqs, rows, allocator, tree, model, False, SpeculativeAlgorithm.NONE)
    batch.prepare_for_extend()
    out = []
    for _ in range(a.steps):
        batch.output_ids = torch.full((a.rows,), 7, dtype=torch.int64)
        if sweep is not None:
            sweep()
        t0 = time.perf_counter_ns()
        batch.prepare_for_decode()
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="requests in the batch (default 8)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="decode steps per batch (default 32)")
    p.add_argument("--layers", type=int, default=3, help="pool layers (glm53-tiny: 3; GLM-5.3: 78)")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--cold", action="store_true", help="sweep the caches before each step")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from sglang.srt import runtime_context
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    sweep = caches.sweeper()[0] if a.cold else None
    args = ServerArgs(model_path="dummy", device="cpu", attention_backend="torch_native")
    rows = tuple(h for h in hooks.HOOKS if h.part in ("zero", "owner") and h.process == "any")
    timed = {}
    with runtime_context.use_context(runtime_context.create_context(args, role="scheduler")):
        timed["upstream"] = [t for _ in range(a.batches) for t in steps(a, sweep)]
        HookRegistry.reset()
        hooks.register(rows)
        HookRegistry.apply_hooks()
        missing = hooks.verify_applied(rows)
        if missing:
            raise SystemExit(f"hooks not applied: {missing}")
        timed["guard on"] = [t for _ in range(a.batches) for t in steps(a, sweep)]
    print(
        f"prepare_for_decode, {a.rows} rows x {a.prompt}+ tokens, DSA pool of {a.layers} layers, page {PAGE}"
        f"{', caches swept before each step' if a.cold else ''}: us per step"
    )
    for side, ts in timed.items():
        ts.sort()
        print(f"  {side:>9}: median {statistics.median(ts):7.1f}, p90 {ts[9 * len(ts) // 10]:7.1f} ({len(ts)} steps)")
    added = statistics.median(timed["guard on"]) - statistics.median(timed["upstream"])
    print(f"  the guard adds {added:.1f} us per step ({added / a.rows:.1f} us per row)")


if __name__ == "__main__":
    main()

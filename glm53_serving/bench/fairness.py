"""Fair share under a flood, on a real deployment through the real gateway.

    python -m glm53_serving.bench.fairness [--topology single|pd] [--seconds 20]

Tenant B (demo-b) sends a modest open-loop load (one short request every --b-interval-s); tenant
A (demo) floods in a closed loop (--a-workers at once, near-limit prompts). Three phases on one
deployment: B alone; A flooding with no limits; A flooding with its fair share set in the running
gateway's tenants file (`[tenants.demo.limits]`, taken without a restart). Printed: B's p50/p99
latency and success rate per phase and the ratio against B alone; A's answers by status (the
excess must be 429, never 5xx). Not a test: numbers, for docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from glm53_serving.bench.serving import start, stop


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def phase(url: str, keys: dict, a: argparse.Namespace, flood: bool) -> tuple[list, Counter, Counter]:
    """B's (latency, status) list and A's and B's status counts over one phase."""
    stop_at = time.monotonic() + a.seconds
    b_results: list[tuple[float, int]] = []
    a_status: Counter = Counter()
    rng = random.Random(7)

    def body(n_prompt: int, max_new: int) -> dict:
        ids = [rng.randrange(5, 500) for _ in range(n_prompt)]  # new to the cache: real prefill work
        return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=256)) as client:

        async def b_one():
            t0 = time.monotonic()
            r = await client.post(
                f"{url}/generate", json=body(32, 16), headers={"Authorization": f"Bearer {keys['demo-b']}"}
            )
            b_results.append((time.monotonic() - t0, r.status_code))

        async def a_worker():
            while time.monotonic() < stop_at:
                r = await client.post(
                    f"{url}/generate",
                    json=body(a.a_prompt, 16),
                    headers={"Authorization": f"Bearer {keys['demo']}"},
                )
                a_status[r.status_code] += 1
                if r.status_code == 429:
                    await asyncio.sleep(0.05)  # a client that backs off a little, not by Retry-After

        flooders = [asyncio.create_task(a_worker()) for _ in range(a.a_workers if flood else 0)]
        await asyncio.sleep(1.0 if flood else 0)  # the flood is on before B's first request
        pending = []
        while time.monotonic() < stop_at:
            pending.append(asyncio.create_task(b_one()))
            await asyncio.sleep(a.b_interval_s)
        await asyncio.gather(*pending, *flooders)
    return b_results, a_status, Counter(s for _, s in b_results)


def report(name: str, b: list, alone: list | None, a_status: Counter) -> None:
    ok = [t for t, s in b if s == 200]
    p50, p99 = percentile(ok, 0.5) * 1000, percentile(ok, 0.99) * 1000
    line = f"{name:>24}: B p50 {p50:7.1f} ms, p99 {p99:7.1f} ms, success {len(ok)}/{len(b)}"
    if alone:
        ok_alone = [t for t, s in alone if s == 200]
        line += (
            f"; vs alone p50 {statistics.median(ok) / statistics.median(ok_alone):.2f}x, "
            f"p99 {percentile(ok, 0.99) / percentile(ok_alone, 0.99):.2f}x"
        )
    if a_status:
        total = sum(a_status.values())
        shares = ", ".join(f"{s}: {n} ({n / total:.1%})" for s, n in sorted(a_status.items()))
        line += f"\n{'':>24}  A's answers: {shares}; 5xx: {sum(n for s, n in a_status.items() if s >= 500)}"
    print(line, flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m glm53_serving.bench.fairness", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", choices=("single", "pd"), default="single")
    p.add_argument("--seconds", type=float, default=20.0, help="per phase")
    p.add_argument("--a-workers", type=int, default=8)
    p.add_argument("--a-prompt", type=int, default=480, help="A's prompt tokens (near the embedded limit)")
    p.add_argument("--b-interval-s", type=float, default=0.5)
    p.add_argument(
        "--a-limits",
        default='{"concurrent": 1, "queue_wait_s": 0.5, "prompt_tokens_per_minute": 30000}',
        help="A's fair share in the limited phase (JSON, tenants.TenantLimits)",
    )
    a = p.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="glm53-fair-")) / "run"
    proc, info = start(run_dir, "--topology", a.topology)
    try:
        keys = json.loads(Path(info["tenants"]["demo_keys_file"]).read_text())
        f = Path(info["tenants"]["file"])
        good = f.read_text()
        url = info["client_url"]
        print(
            f"fairness: {a.topology}, {a.seconds:.0f} s per phase; A floods with {a.a_workers} workers x {a.a_prompt}-token prompts, "
            f"B one 32-token request every {a.b_interval_s} s; run dir {run_dir}",
            flush=True,
        )
        alone, _, _ = asyncio.run(phase(url, keys, a, flood=False))
        report("B alone", alone, None, Counter())
        unlimited, a_unl, _ = asyncio.run(phase(url, keys, a, flood=True))
        report("A flooding, no limits", unlimited, alone, a_unl)
        limits = json.loads(a.a_limits)
        f.write_text(good + "\n[tenants.demo.limits]\n" + "".join(f"{k} = {v}\n" for k, v in limits.items()))
        time.sleep(2.5)  # the gateway's poll
        limited, a_lim, _ = asyncio.run(phase(url, keys, a, flood=True))
        report(f"A flooding, limited {limits}", limited, alone, a_lim)
    finally:
        stop(proc)


if __name__ == "__main__":
    main()

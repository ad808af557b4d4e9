"""Cold caches for micro-benchmarks: a buffer twice the CPU's last-level cache, written before
each timed call.

In a server nothing the KV guard touches stays cache-resident between its calls: a KV pool of
GBs, and a forward pass between two allocations or decode steps that writes activations and reads
weights. A micro-benchmark that calls the same function back to back measures it out of cache,
and a baseline memset of a few MiB runs there at several times DRAM bandwidth.
"""

from __future__ import annotations

import glob
from collections.abc import Callable

import torch

FALLBACK_BYTES = 32 << 20


def last_level_cache_bytes(cpu: str = "/sys/devices/system/cpu/cpu0") -> int:
    """The largest CPU cache sysfs lists for `cpu` (e.g. "491520K"); FALLBACK_BYTES if none."""
    sizes = []
    for path in glob.glob(f"{cpu}/cache/index*/size"):
        with open(path) as f:
            text = f.read().strip()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=FALLBACK_BYTES)


def sweeper(nbytes: int | None = None) -> tuple[Callable[[], None], int]:
    """A function that writes `nbytes` (default: twice the last-level cache), and that size."""
    nbytes = nbytes or 2 * last_level_cache_bytes()
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)

    def sweep() -> None:
        buf.add_(1)

    return sweep, nbytes

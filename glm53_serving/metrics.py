"""Prometheus counters of the guards, created on first use and never able to break a request.

Created lazily because prometheus_client must be imported after SGLang has set
PROMETHEUS_MULTIPROC_DIR, or the counters would not appear on the server's /metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("glm53_serving")


@dataclass(slots=True)
class LazyCounter:
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    _counter: Any = field(default=None, repr=False)

    def inc(self, amount: float = 1, **labels: str) -> None:
        try:
            if self._counter is None:
                from prometheus_client import Counter

                self._counter = Counter(self.name, self.doc, list(self.labels))
            (self._counter.labels(**labels) if self.labels else self._counter).inc(amount)
        except Exception:  # noqa: BLE001 - a metric must never turn a 4xx into a 500 or break allocation
            logger.exception("glm53_serving: counting %s failed", self.name)


# Shared by the KV guard's parts (kv_owner.py, kv_handoff.py): one series per place it was caught.
KV_VIOLATIONS = LazyCounter(
    "glm53_kv_isolation_violations",
    "Requests aborted: their KV row held pages of another owner, or their PD handoff did not cover their prompt",
    ("where",),
)

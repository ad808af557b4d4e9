"""Fair share at the gateway: per-tenant limits, so that one tenant at its limit is refused with
`429 rate_limit_exceeded` while every other tenant is served as if it were alone.

Per tenant, never shared between tenants (a limiter with one queue for everyone would be the
cross-tenant denial of service we removed from the router):
- `concurrent`: requests in flight (from admission to the answer's last byte); a request over it
  waits in the tenant's own queue for at most `queue_wait_s`, then gets a 429;
- `requests_per_minute` and `prompt_tokens_per_minute`: token buckets (a minute's worth of
  burst), refilled continuously; an empty bucket is a 429 at once, with `Retry-After` saying when
  the request would fit.
A limit of 0 means unlimited. Deployment defaults come from the topology file; a tenant's own
`limits` table in the tenants file overrides them (reloaded with the file, docs/operations.md).
"""

from __future__ import annotations

import asyncio
import math
import time

from glm53_serving.errors import ClientError
from glm53_serving.tenants import TenantLimits


class Bucket:
    """A token bucket of `per_minute` tokens, full at start; `clock` is injectable for tests."""

    def __init__(self, per_minute: int, clock=time.monotonic):
        self.rate, self.capacity, self.clock = per_minute / 60.0, float(per_minute), clock
        self.level, self.at = self.capacity, clock()

    def take(self, n: float) -> float:
        """Take `n` tokens, or none: 0.0 when taken, else the seconds until they would fit. A
        request larger than the whole bucket fits once the bucket is full."""
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now
        need = min(n, self.capacity)
        if self.level >= need:
            self.level -= n  # may go negative for an over-capacity request: it pays its debt
            return 0.0
        return (need - self.level) / self.rate


class TenantShare:
    """One tenant's state: its slots and buckets, sized from its limits."""

    def __init__(self, limits: TenantLimits, clock=time.monotonic):
        self.limits = limits
        self.slots = asyncio.Semaphore(limits.concurrent) if limits.concurrent else None
        self.requests = Bucket(limits.requests_per_minute, clock) if limits.requests_per_minute else None
        self.tokens = Bucket(limits.prompt_tokens_per_minute, clock) if limits.prompt_tokens_per_minute else None


def refuse(what: str, retry_after_s: float) -> ClientError:
    retry = max(1, math.ceil(retry_after_s))
    return ClientError(
        "rate_limit_exceeded",
        f"This API key is over its {what}; retry after {retry} s. Other tenants are not affected.",
        details={"retry_after_s": retry},
    )


class FairShare:
    """Every tenant's share. `admit` before forwarding; `release` when the answer is done."""

    def __init__(self, defaults: TenantLimits, per_tenant=None, clock=time.monotonic):
        self.defaults, self.clock = defaults, clock
        self.per_tenant = per_tenant or (lambda tenant: None)  # tenant -> its own limits table
        self._shares: dict[str, TenantShare] = {}

    def share(self, tenant: str) -> TenantShare:
        limits = self.defaults.over(self.per_tenant(tenant))
        share = self._shares.get(tenant)
        if share is None or share.limits != limits:  # new, or its limits changed (file reloaded)
            share = self._shares[tenant] = TenantShare(limits, self.clock)
        return share

    def counts_tokens(self, tenant: str) -> bool:
        return self.share(tenant).tokens is not None

    def charge(self, tenant: str, prompt_tokens: int) -> None:
        """Take one request and its prompt from the tenant's buckets, or raise a 429 (nothing
        taken from either bucket then)."""
        share = self.share(tenant)
        if share.requests is not None:
            wait = share.requests.take(1)
            if wait:
                raise refuse(f"requests per minute ({share.limits.requests_per_minute})", wait)
        if share.tokens is not None:
            wait = share.tokens.take(prompt_tokens)
            if wait:
                if share.requests is not None:
                    share.requests.level += 1  # give the request back
                raise refuse(f"prompt tokens per minute ({share.limits.prompt_tokens_per_minute})", wait)

    async def enter(self, tenant: str) -> asyncio.Semaphore | None:
        """A slot among the tenant's concurrent requests (waiting in its own queue for at most
        queue_wait_s), or a 429. Returns what `leave` must release."""
        share = self.share(tenant)
        if share.slots is None:
            return None
        if share.slots.locked() and not share.limits.queue_wait_s:
            raise refuse(f"concurrent requests ({share.limits.concurrent})", 1)
        try:
            await asyncio.wait_for(share.slots.acquire(), share.limits.queue_wait_s or None)
        except TimeoutError:
            raise refuse(f"concurrent requests ({share.limits.concurrent})", 1) from None
        return share.slots

"""Fair share at the gateway: per-tenant buckets and slots, a tenant's own limits over the
deployment's, and the 429 a tenant over its share gets while another tenant is served."""

import asyncio
import threading
import time

import pytest

from glm53_serving import tenants
from glm53_serving.errors import ClientError
from glm53_serving.gateway.fair_share import Bucket, FairShare
from glm53_serving.tenants import TenantLimits
from tests.unit.test_gateway_upstream import BODY, KEY, gateway_config, upstream  # noqa: F401 (a fixture)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_a_bucket_allows_a_minutes_burst_then_refills_continuously():
    clock = Clock()
    b = Bucket(60, clock)
    assert all(b.take(1) == 0.0 for _ in range(60))
    assert b.take(1) == pytest.approx(1.0)
    clock.t += 0.5
    assert b.take(1) == pytest.approx(0.5)  # nothing taken by a refusal
    clock.t += 0.5
    assert b.take(1) == 0.0
    big = Bucket(100, clock)
    assert big.take(250) == 0.0  # larger than the bucket: fits when full, then pays its debt
    assert big.take(1) == pytest.approx(151 * 60 / 100)


def test_charge_refuses_with_retry_after_and_takes_nothing_from_a_refused_request():
    clock = Clock()
    fair = FairShare(TenantLimits(requests_per_minute=2, prompt_tokens_per_minute=600), clock=clock)
    fair.charge("acme", 500)
    with pytest.raises(ClientError) as e:
        fair.charge("acme", 200)  # the tokens do not fit: the request is given back
    assert e.value.code == "rate_limit_exceeded" and e.value.status == 429
    assert e.value.details["retry_after_s"] == 10 and "prompt tokens per minute (600)" in e.value.message
    fair.charge("acme", 100)  # the request given back is still there
    with pytest.raises(ClientError) as e:
        fair.charge("acme", 1)
    assert "requests per minute (2)" in e.value.message and e.value.details["retry_after_s"] == 30
    fair.charge("beta", 600)  # another tenant: its own buckets, full
    clock.t += 30
    fair.charge("acme", 1)


def test_a_tenants_queue_is_its_own_and_bounded_in_time():
    async def run():
        fair = FairShare(TenantLimits(concurrent=2, queue_wait_s=0.2))
        held = [await fair.enter("acme"), await fair.enter("acme")]
        t0 = time.monotonic()
        with pytest.raises(ClientError) as e:
            await fair.enter("acme")
        waited = time.monotonic() - t0
        assert e.value.code == "rate_limit_exceeded" and 0.15 < waited < 1.0
        assert (await asyncio.wait_for(fair.enter("beta"), 0.05)) is not None  # beta never waits on acme
        waiting = asyncio.ensure_future(fair.enter("acme"))
        await asyncio.sleep(0.05)
        held.pop().release()  # a slot frees while acme's next request waits: it gets it
        assert (await waiting) is not None

    asyncio.run(run())


def test_no_queue_is_an_immediate_429_and_unlimited_takes_no_slot():
    async def run():
        fair = FairShare(TenantLimits(concurrent=1))
        await fair.enter("acme")
        t0 = time.monotonic()
        with pytest.raises(ClientError):
            await fair.enter("acme")
        assert time.monotonic() - t0 < 0.05
        assert await FairShare(TenantLimits()).enter("acme") is None

    asyncio.run(run())


def test_a_tenants_own_limits_override_the_deployments_and_follow_the_file(tmp_path):
    f = tmp_path / "t.toml"
    tenants.add_tenant(f, "acme")
    tenants.add_tenant(f, "beta")
    f.write_text(f.read_text() + "\n[tenants.acme.limits]\nconcurrent = 1\nrequests_per_minute = 5\n")
    live = tenants.LiveTenants(f)
    fair = FairShare(TenantLimits(concurrent=4, queue_wait_s=1.0), lambda t: live.current.limits.get(t))
    assert fair.share("acme").limits == TenantLimits(1, 5, 0, 1.0)
    assert fair.share("beta").limits == TenantLimits(concurrent=4, queue_wait_s=1.0)
    f.write_text(f.read_text().replace("concurrent = 1", "concurrent = 3"))
    assert live.reload() == "ok" and fair.share("acme").limits.concurrent == 3


@pytest.mark.parametrize(
    "table, words",
    [
        ("concurrent = -1", "concurrent must be an integer >= 0"),
        ("concurrent = 1.5", "concurrent must be an integer >= 0"),
        ("requests_per_minute = true", "requests_per_minute must be an integer"),
        ("queue_wait_s = -0.5", "queue_wait_s must be a number >= 0"),
        ("burst = 3", "unknown ['burst']"),
    ],
)
def test_bad_limits_are_refused_where_they_are_written(tmp_path, table, words):
    f = tmp_path / "t.toml"
    tenants.add_tenant(f, "acme")
    f.write_text(f.read_text() + f"\n[tenants.acme.limits]\n{table}\n")
    with pytest.raises(tenants.TenantsError, match=__import__("re").escape(words)):
        tenants.TenantsFile.load(f)


def test_the_gateway_answers_a_tenant_over_its_share_429_and_serves_the_other(upstream, tmp_path):  # noqa: F811
    from starlette.testclient import TestClient

    from glm53_serving.gateway.app import build_app

    f = tmp_path / "t.toml"
    keys = {t: tenants.add_tenant(f, t) for t in ("acme", "beta")}
    f.write_text(f.read_text() + "\n[tenants.acme.limits]\nconcurrent = 1\n")
    cfg = gateway_config(upstream, tenants=tenants.LiveTenants(f), assertion_key=KEY)
    with TestClient(build_app(cfg)) as gw:

        def post(tenant, **kw):
            return gw.post("/generate", headers={"Authorization": f"Bearer {keys[tenant]}"}, **kw)

        streaming = threading.Event()

        def slow():  # holds acme's only slot for ~1.5 s
            with gw.stream(
                "POST",
                "/generate?delay=0.3",
                json={**BODY, "stream": True},
                headers={"Authorization": f"Bearer {keys['acme']}"},
            ) as r:
                for _ in r.iter_bytes():
                    streaming.set()

        t = threading.Thread(target=slow)
        t.start()
        assert streaming.wait(10)
        r = post("acme", json=BODY)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error" and err["retry_after_s"] == 1
        assert post("beta", json=BODY).status_code == 200  # the other tenant is served meanwhile
        t.join(10)
        assert post("acme", json=BODY).status_code == 200  # the slot came back with the stream's end

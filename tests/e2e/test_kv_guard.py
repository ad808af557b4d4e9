"""Zero before reuse on real PD servers: decode attending over pages nothing wrote reads zeros,
never the KV that earlier requests (other tenants) left there.

The probe is upstream's fake-bootstrap path (`bootstrap_host` 2.2.2.2: decode pre-allocates the
prompt's pages and skips the transfer), sent straight to the decode server: exactly the
incident's situation, decode over never-written pages. Its greedy output is a function of what
those pages hold. With the guard it must not depend on earlier traffic; without it, it does
(the second test shows the probe fails on an unguarded deployment)."""

import httpx
import pytest

from tests.e2e.deployment import P
from tests.e2e.launcher import auth, launch

pytestmark = pytest.mark.e2e


def probe(decode_url: str) -> list[int]:
    # The fake bootstrap host is refused to tenants; the operator may use it (this probe).
    r = httpx.post(
        f"{decode_url}/generate",
        timeout=60,
        headers=auth(decode_url, "admin"),
        json={
            "rid": "kv-guard-probe",  # the synthetic handoff token is derived from the rid
            "input_ids": [9] * 64,
            "bootstrap_host": "2.2.2.2",
            "bootstrap_port": 8998,
            "bootstrap_room": 1,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def churn(client_url: str, seed: int) -> None:
    """Other requests, enough tokens to wrap decode's 2048-slot pool twice."""
    n = min(400, P - 10)  # prompts the deployment takes
    for k in range(12):
        r = httpx.post(
            f"{client_url}/generate",
            timeout=120,
            headers=auth(client_url),
            json={
                "input_ids": [(i * seed + k) % 400 + 5 for i in range(n)],
                "sampling_params": {"max_new_tokens": 4},
            },
        )
        assert r.status_code == 200, r.text


def outputs_across_traffic(run) -> list[list[int]]:
    decode = run.worker("decode-0")
    seen = [probe(decode)]
    for seed in (7, 13):
        churn(run.url, seed)
        seen.append(probe(decode))
    return seen


def test_decode_over_unwritten_pages_reads_zeros_not_earlier_requests_kv(pd):
    first, *later = outputs_across_traffic(pd)
    assert all(o == first for o in later), (first, later)


def test_the_probe_sees_stale_kv_on_an_unguarded_deployment(tmp_path):
    run = launch(tmp_path, env={"GLM53_SERVING_DISABLE": "1"})
    try:
        seen = outputs_across_traffic(run)
    finally:
        run.stop()
    assert len({tuple(o) for o in seen}) > 1, "the probe did not observe stale KV: it could not catch a leak"

"""Regression tests for requests that killed or wedged upstream SGLang 0.5.23 (measured), named
after what they reproduce. After each rejected request the server serves the next one."""

import time

import httpx
import pytest

from tests.e2e.launcher import auth

pytestmark = pytest.mark.e2e


def serves_normally(url):
    r = httpx.post(f"{url}/generate", timeout=120, headers=auth(url), json={
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 4


@pytest.mark.parametrize("bad", [-1, 512, 10**9], ids=["negative", "vocab_size", "huge"])
def test_out_of_vocabulary_token_id_does_not_kill_the_single_server(single, bad):
    server = single.worker("server")
    r = httpx.post(f"{server}/generate", timeout=30, headers=auth(server), json={"input_ids": [5, bad, 6], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_request_error" and err["param"] == "input_ids" and str(bad) in err["message"]
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200
    serves_normally(single.url)


@pytest.mark.parametrize("bad", [-1, 512], ids=["negative", "vocab_size"])
def test_out_of_vocabulary_token_id_does_not_hang_pd(pd, bad):
    t0 = time.monotonic()
    r = httpx.post(f"{pd.url}/generate", timeout=30, headers=auth(pd.url), json={"input_ids": [5, bad], "sampling_params": {"max_new_tokens": 2}})
    assert time.monotonic() - t0 < 2.0
    assert r.status_code == 400 and str(bad) in r.json()["error"]["message"]
    for w in ("prefill-0", "decode-0"):
        assert httpx.get(f"{pd.worker(w)}/health", timeout=30).status_code == 200
    serves_normally(pd.url)


@pytest.mark.parametrize("role", ["decode-0", "prefill-0"])
def test_generate_without_bootstrap_fields_does_not_kill_the_pd_server(pd, role):
    worker = pd.worker(role)
    r = httpx.post(f"{worker}/generate", timeout=30, headers=auth(worker), json={
        "input_ids": [5, 6, 7], "bootstrap_room": 123, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "bootstrap_host" and "routed by its deployment" in err["message"]
    assert httpx.get(f"{worker}/health", timeout=30).status_code == 200
    serves_normally(pd.url)

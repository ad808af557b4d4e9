"""GLM-5.3's architecture on CPU: glm53-tiny (MLA + DSA sparse indexer with an fp8
index-K cache, sigmoid MoE, 64-token pages, DSATokenToKVPool) served by a real single server and
a real PD pair (launch/cpu.toml) with the plugin's patches, greedy-equal to HF transformers
with the same fp8 index-key quantisation (tests/hf_reference.py), with the KV guard on that pool
and decode retraction under memory pressure."""

import httpx
import pytest

from glm53_serving.models import dsa_tiny
from glm53_serving.topology import REPO_LAUNCH_DIR
from tests import hf_reference
from tests.e2e.launcher import alive, auth, launch

pytestmark = pytest.mark.e2e

SHORT = [(i * 37 + 11) % 400 + 7 for i in range(17)]
LONG = [(i * 53 + 5) % 450 + 7 for i in range(100)]  # > index_topk (16), two 64-token pages
N_NEW = 12


@pytest.fixture(scope="module")
def dsa(tmp_path_factory):
    run = launch(
        tmp_path_factory.mktemp("run-dsa"), "--config", str(REPO_LAUNCH_DIR / "cpu.toml"), "--topology", "single"
    )
    yield run
    run.stop()
    assert not alive(run.info["all_pids"])


@pytest.fixture(scope="module")
def reference():
    model = hf_reference.load(dsa_tiny.ensure())
    return lambda ids: hf_reference.greedy(model, ids, N_NEW)


def generate(url, ids):
    r = httpx.post(
        f"{url}/generate",
        timeout=300,
        headers=auth(url),
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True}},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["meta_info"]["completion_tokens"] == N_NEW
    return body["output_ids"], body["meta_info"]


@pytest.mark.parametrize("ids", [SHORT, LONG], ids=["17-tokens", "100-tokens"])
def test_greedy_equals_hf_with_fp8_index_keys(dsa, reference, ids):
    assert generate(dsa.url, ids)[0] == reference(ids)


def test_a_shared_64_token_prefix_hits_the_cache_and_still_equals_hf(dsa, reference):
    prefix = LONG[:64]
    generate(dsa.url, prefix + SHORT)
    ids = prefix + SHORT[::-1] + LONG[64:80]
    out, meta = generate(dsa.url, ids)
    assert meta["cached_tokens"] >= 64  # a whole page of latent and index-K reused
    assert out == reference(ids)


def test_a_batch_of_two_equals_hf_for_each(dsa, reference):
    # One request with two prompts of different lengths: a 2-sequence extend and 2-request decode
    # batches, through the per-request loops of the indexer and of sparse attention.
    pair = [SHORT[::-1] + LONG[:20], LONG[::-1]]
    r = httpx.post(
        f"{dsa.url}/generate",
        timeout=300,
        headers=auth(dsa.url),
        json={"input_ids": pair, "sampling_params": {"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True}},
    )
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == [reference(ids) for ids in pair]


def test_the_kv_guard_runs_on_the_dsa_pool(dsa):
    from glm53_serving import hooks

    generate(dsa.url, SHORT)
    url = dsa.worker("server")
    status = httpx.get(f"{url}/server_info", timeout=30, headers=auth(url, "admin")).json()["glm53_serving"]
    assert status["active"] is True and status["kv_pool"] == "DSATokenToKVPool"
    assert status["kv_guard"] == {"zero": True, "owner": True, "handoff": True}
    assert set(status["hooks"]) == {h.target for h in hooks.active_hooks(cpu=True, guards=True, dsa=True)}
    assert status["capacity"]["page_size"] == dsa_tiny.PAGE_SIZE
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    for counter in ("glm53_kv_zeroed_slots_total", "glm53_kv_owner_checked_requests_total"):
        values = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(counter)]
        assert values and sum(values) > 0, counter


# --- PD: prefill hands latent and index-K pages to decode over Mooncake ----------------------------

DECODE_POOL = 512  # 8 pages: four 300-token requests cannot all stay on decode at once


@pytest.fixture(scope="module")
def dsa_pd(tmp_path_factory):
    d = tmp_path_factory.mktemp("run-dsa-pd")
    cfg = d / "cpu-dsa-pd.toml"
    text = (REPO_LAUNCH_DIR / "cpu.toml").read_text()
    cfg.write_text(text.replace("[decode]\ncount = 1", f"[decode]\ncount = 1\nkv_tokens = {DECODE_POOL}"))
    run = launch(d / "run", "--config", str(cfg))
    yield run
    run.stop()
    assert not alive(run.info["all_pids"])


@pytest.mark.parametrize("ids", [SHORT, LONG], ids=["17-tokens", "100-tokens"])
def test_pd_greedy_equals_hf(dsa_pd, reference, ids):
    """The transfer carries every page decode reads: the latent and the index-K keys and scales
    (a missing index-K page would change the sparse selection, and so the tokens)."""
    assert generate(dsa_pd.url, ids)[0] == reference(ids)


def test_pd_decode_retracts_under_memory_pressure_and_every_answer_equals_its_solo_run(dsa_pd):
    """Four 300-token generations on a 512-token decode pool: decode retracts some (their latent
    and index-K pages backed up to host memory, cpu_dsa's row), serves the others, brings them back,
    and each answer is the one it gets alone."""
    import threading

    prompts = [[(i * 31 + k * 97) % 450 + 7 for i in range(100)] for k in range(4)]
    body = lambda ids: {  # noqa: E731
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True},
    }

    def post(ids):
        r = httpx.post(f"{dsa_pd.url}/generate", json=body(ids), timeout=600, headers=auth(dsa_pd.url))
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    solo = [post(ids) for ids in prompts]
    together: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda k=k: together.__setitem__(k, post(prompts[k]))) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert [together.get(k) for k in range(4)] == solo
    log = (dsa_pd.run_dir / "decode-0.log").read_text()
    assert "KV cache pool is full. Retract requests." in log  # the pressure was real


def test_prefix_pages_are_shared_within_a_tenant_and_never_across(dsa, reference):
    """64-token pages: a tenant's second request reuses whole pages of its first (latent and
    index-K); another tenant's identical prompt reuses none, and both get the model's answer."""
    ids = [(i * 41 + 3) % 460 + 7 for i in range(150)]  # two whole pages and a partial one

    def served(tenant):
        r = httpx.post(
            f"{dsa.url}/generate",
            timeout=300,
            headers=dsa.client_headers(tenant),
            json={"input_ids": ids, "sampling_params": {"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True}},
        )
        assert r.status_code == 200, r.text
        return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens"]

    first, cold = served("demo")
    again, warm = served("demo")
    other, across = served("demo-b")
    assert cold == 0 and warm == 128 and across == 0, (cold, warm, across)  # whole pages, one tenant's
    assert first == again == other == reference(ids)

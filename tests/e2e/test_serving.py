"""Real servers on glm53-tiny: the single server and the PD deployment (prefill + decode over
Mooncake TCP + sglang-router) answer every generation endpoint with real content, and greedy
output equals HF transformers' on the same weights."""

import json

import httpx
import pytest

from glm53_serving.topology import DSA_PRESETS, Topology
from tests.e2e.deployment import CONFIG, MODEL, TOPOLOGY, reference_greedy, reference_model
from tests.e2e.launcher import auth

pytestmark = pytest.mark.e2e
DSA = TOPOLOGY.model.preset in DSA_PRESETS  # the hook table's dsa_only rows are active

PROMPT_IDS = [(i * 37 + 11) % 400 + 7 for i in range(120)]  # long enough that the KV really matters
N_NEW = 24


@pytest.fixture(params=["single", "pd"])
def topo(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def hf_greedy():
    model = reference_model()

    def run(ids, n):  # full recompute each step: the plainest possible reference
        return reference_greedy(model, ids, n)

    return run


def generate_ids(url, ids, n=N_NEW):
    r = httpx.post(
        f"{url}/generate",
        timeout=120,
        headers=auth(url),
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["meta_info"]["completion_tokens"] == n
    return body["output_ids"]


def chat(url, stream, content="Write a function that sorts a list.", max_tokens=12):
    return httpx.post(
        f"{url}/v1/chat/completions",
        timeout=120,
        headers=auth(url),
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        },
    )


def sse_events(text):
    lines = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-500:]
    return [json.loads(line) for line in lines[:-1]]


def test_generate_matches_hf_greedy(topo, hf_greedy):
    assert generate_ids(topo.url, PROMPT_IDS) == hf_greedy(PROMPT_IDS, N_NEW)


def test_pd_decode_output_equals_single_server_output(single, pd):
    # Decode computes nothing of the prompt itself: equal output means the KV really travelled.
    ids = PROMPT_IDS[::-1]
    assert generate_ids(pd.url, ids) == generate_ids(single.url, ids)


def test_generate_text(topo):
    r = httpx.post(
        f"{topo.url}/generate",
        timeout=120,
        headers=auth(topo.url),
        json={"text": "Hello world", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}},
    )
    assert r.status_code == 200
    body = r.json()
    assert len(body["output_ids"]) == 8 and isinstance(body["text"], str) and body["text"]
    assert body["meta_info"]["finish_reason"]["type"] == "length"


def test_chat_completion(topo):
    r = chat(topo.url, stream=False)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"]
    assert body["usage"]["completion_tokens"] == 12 and body["usage"]["prompt_tokens"] > 5


def test_chat_stream_equals_non_stream(topo):
    whole = chat(topo.url, stream=False).json()["choices"][0]["message"]["content"]
    r = chat(topo.url, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert streamed == whole


def test_completions(topo):
    r = httpx.post(
        f"{topo.url}/v1/completions",
        timeout=120,
        headers=auth(topo.url),
        json={"model": MODEL, "prompt": "def main():", "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] and r.json()["usage"]["completion_tokens"] == 8


def test_models(topo):
    r = httpx.get(f"{topo.url}/v1/models", timeout=30)
    assert r.status_code == 200
    (m,) = r.json()["data"]
    _, limits = Topology.load(CONFIG, topo.info["topology"]).admission_plan()
    # what is served (docs/admission.md), not the configured window
    assert (m["id"], m["max_model_len"], m["max_input_tokens"]) == (
        MODEL,
        limits.max_model_len,
        limits.max_prompt_tokens,
    )


def test_every_worker_runs_every_guard(single, pd):
    """Not only "active" (which says the guards were not switched off): every hook row of the table
    is in place in the server, every KV guard part is on, the deployment's limits are the ones
    enforced, and the guards demonstrably ran on the requests above (zeroing, owner checks)."""
    from glm53_serving import hooks

    want = {h.target for h in hooks.active_hooks(cpu=True, guards=True, dsa=DSA)}
    for run, name, topology in ((single, "server", "single"), (pd, "prefill-0", "pd"), (pd, "decode-0", "pd")):
        url = run.worker(name)
        generate_ids(run.url, PROMPT_IDS[:40], 4)
        status = httpx.get(f"{url}/server_info", timeout=30, headers=auth(url, "admin")).json()["glm53_serving"]
        assert status["active"] is True and status["disabled_by"] is None and status["tenants"] == "enforced"
        assert set(status["hooks"]) == want, set(status["hooks"]) ^ want
        assert status["kv_guard"] == {"zero": True, "owner": True, "handoff": True}
        _, limits = Topology.load(CONFIG, topology).admission_plan()
        assert (status["limits"]["max_input_tokens"], status["limits"]["max_total_tokens"]) == (
            limits.max_input_tokens,
            limits.max_total_tokens,
        )
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        for counter in ("glm53_kv_zeroed_slots_total", "glm53_kv_owner_checked_requests_total"):
            values = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(counter)]
            assert values and sum(values) > 0, (name, counter)

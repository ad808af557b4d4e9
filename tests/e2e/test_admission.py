"""One length limit, hard 4xx everywhere: real servers, both topologies, at the client endpoint
and straight to each worker. Every rejection is checked by content (contract body, numbers) and
by the server's own counters (no token generated), not by status alone."""

import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from glm53_serving.topology import Topology, free_port
from tests.e2e.deployment import CONTEXT, MODEL, P, T, config_text, set_keys
from tests.e2e.launcher import alive, auth, launch

pytestmark = pytest.mark.e2e


# Output tokens a longest prompt (P - 1) can still have: 4 where the budget allows (with 64-token
# pages the largest prompt can leave room for one token only: docs/admission.md).
OUT_AT_LIMIT = min(4, T - (P - 1))


def over_length(endpoint, stream, n_prompt=P, max_new=4):
    """A request whose prompt has exactly n_prompt tokens (or, for text endpoints, at least)."""
    if endpoint == "/generate":
        return {"input_ids": [5] * n_prompt, "stream": stream, "sampling_params": {"max_new_tokens": max_new}}
    text = "hello world " * n_prompt  # >= 2 tokens per repetition with the tiny models' tokenizer
    if endpoint == "/v1/completions":
        return {"model": MODEL, "prompt": text, "max_tokens": max_new, "stream": stream}
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_new,
        "stream": stream,
    }


def metric(url, name, **labels):
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def generated_tokens(url):
    return metric(url, "sglang:generation_tokens_histogram_sum")


def assert_contract_400(r, prompt_at_least=P, limits=(P, T)):
    assert r.status_code == 400, r.text[:500]
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
    assert (
        err["prompt_tokens"] >= prompt_at_least
        or err["prompt_tokens"] + (err["max_new_tokens"] or 0) > err["max_total_tokens"]
    )
    assert (err["max_input_tokens"], err["max_total_tokens"]) == limits
    return err


ENDPOINTS = ["/generate", "/v1/completions", "/v1/chat/completions"]


def worker_urls(single, pd):
    return {"single": single.worker("server"), "prefill": pd.worker("prefill-0"), "decode": pd.worker("decode-0")}


@pytest.mark.parametrize("where", ["single", "prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_over_length_is_a_contract_400_before_any_token(single, pd, where, endpoint, stream):
    url = worker_urls(single, pd)[where]
    before_tokens, before_rej = generated_tokens(url), metric(url, "glm53_rejections_total", endpoint=endpoint)
    r = httpx.post(f"{url}{endpoint}", json=over_length(endpoint, stream), timeout=30, headers=auth(url))
    assert_contract_400(r)
    assert metric(url, "glm53_rejections_total", endpoint=endpoint, reason="context_length_exceeded") == before_rej + 1
    assert generated_tokens(url) == before_tokens  # the scheduler never ran it


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_over_length_straight_to_the_router_is_a_fast_4xx_and_nothing_runs(pd, endpoint, stream):
    # Behind the gateway, for what reaches the router some other way: sglang-router rewrites PD
    # error bodies and cuts streaming ones (patches/sglang-router-0.3.2-pd-error-bodies.md), but
    # the status holds, it is fast, and neither worker generates anything.
    workers = [pd.worker("prefill-0"), pd.worker("decode-0")]
    before = [generated_tokens(w) for w in workers]
    r = httpx.post(
        f"{pd.worker('router')}{endpoint}",
        json=over_length(endpoint, stream),
        timeout=30,
        headers=auth(pd.worker("router")),
    )
    assert r.status_code == 400
    assert f"prompts of at most {P - 1} tokens" in r.text
    assert [generated_tokens(w) for w in workers] == before


@pytest.mark.parametrize("topology", ["single", "pd"])
@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_over_length_at_the_client_endpoint_is_the_contract_400(single, pd, topology, endpoint, stream):
    run = single if topology == "single" else pd
    workers = [single.worker("server")] if topology == "single" else [pd.worker("prefill-0"), pd.worker("decode-0")]
    before = [metric(w, "glm53_rejections_total") for w in workers]
    r = httpx.post(f"{run.url}{endpoint}", json=over_length(endpoint, stream), timeout=30, headers=auth(run.url))
    assert_contract_400(r)
    # The gateway rejected it: no worker (nor the router) saw the request.
    assert [metric(w, "glm53_rejections_total") for w in workers] == before
    assert (
        metric(
            run.info["operator_url"],
            "glm53_gateway_requests_total",
            endpoint=endpoint,
            status="400",
            reason="context_length_exceeded",
        )
        >= 1
    )


@pytest.mark.parametrize("where", ["single", "pd"])
def test_exactly_at_the_limit_rejected_one_below_served(single, pd, where):
    url = single.url if where == "single" else pd.url
    r = httpx.post(f"{url}/generate", json=over_length("/generate", False, n_prompt=P), timeout=30, headers=auth(url))
    assert r.status_code == 400 and f"the prompt has {P}" in r.text
    ok = httpx.post(
        f"{url}/generate",
        timeout=120,
        headers=auth(url),
        json={
            "input_ids": [5] * (P - 1),
            "sampling_params": {"max_new_tokens": OUT_AT_LIMIT, "temperature": 0, "ignore_eos": True},
        },
    )
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["output_ids"]) == OUT_AT_LIMIT and ok.json()["meta_info"]["prompt_tokens"] == P - 1


@pytest.mark.parametrize("where", ["single", "prefill", "decode"])
def test_prompt_plus_max_tokens_over_the_budget_is_400_not_silent_clipping(single, pd, where):
    url = worker_urls(single, pd)[where]
    r = httpx.post(
        f"{url}/generate",
        timeout=30,
        headers=auth(url),
        json={"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": T - 100 + 1, "ignore_eos": True}},
    )
    err = assert_contract_400(r, prompt_at_least=0)
    assert err["param"] == "max_tokens" and err["max_new_tokens"] == T - 99


def test_prompt_plus_max_tokens_at_the_budget_is_served_in_full(single):
    r = httpx.post(
        f"{single.url}/generate",
        timeout=300,
        headers=auth(single.url),
        json={
            "input_ids": [5] * 10,
            "sampling_params": {"max_new_tokens": T - 10, "temperature": 0, "ignore_eos": True},
        },
    )
    assert r.status_code == 200
    assert r.json()["meta_info"]["completion_tokens"] == T - 10  # not clipped


def served_exactly(url, prompt, total, limits=(P, T)):
    """`/v1/models`' numbers are what is served: the largest prompt with the rest of the budget as
    output, the smallest prompt with the whole budget, both generated in full (200); one token more
    of either is the contract 400 naming the field."""

    def generate(n_prompt, n_new):
        return httpx.post(
            f"{url}/generate",
            timeout=600,
            headers=auth(url),
            json={
                "input_ids": [5] * n_prompt,
                "sampling_params": {"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True},
            },
        )

    for n_prompt in (prompt, 1):
        r = generate(n_prompt, total - n_prompt)
        assert r.status_code == 200, r.text[:500]
        assert r.json()["meta_info"]["completion_tokens"] == total - n_prompt
        err = assert_contract_400(generate(n_prompt, total - n_prompt + 1), prompt_at_least=0, limits=limits)
        assert err["param"] == "max_tokens"
    err = assert_contract_400(generate(prompt + 1, 1), prompt_at_least=prompt + 1, limits=limits)
    assert err["param"] == "input_ids"
    # No max_tokens: the rest of the budget, not what SGLang's context window would allow (with
    # 64-token pages a largest prompt got 127 tokens where 1 is served).
    unset = generate(prompt, None)
    assert unset.status_code == 200 and unset.json()["meta_info"]["completion_tokens"] == total - prompt, unset.text


@pytest.mark.parametrize("where", ["single", "pd"])
def test_the_advertised_window_is_exactly_what_is_served(single, pd, where):
    run = single if where == "single" else pd
    (m,) = httpx.get(f"{run.url}/v1/models", timeout=30, headers=auth(run.url)).json()["data"]
    assert (m["max_input_tokens"], m["max_model_len"]) == (P - 1, T)
    served_exactly(run.url, m["max_input_tokens"], m["max_model_len"])


# --- asymmetric PD pools: what upstream parks (client hangs) must be a 4xx within 1 s -----------


def asym_config(tmp_path, prefill_kv, decode_kv):
    text = set_keys(config_text(), "admission", clamp_context_to_kv="true")
    text = set_keys(text, "prefill", kv_tokens=prefill_kv)
    text = set_keys(text, "decode", decode_reserve=16, kv_tokens=decode_kv)
    p = tmp_path / "asym.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("prefill_kv, decode_kv", [(2048, 256), (256, 2048)], ids=["decode-smaller", "prefill-smaller"])
def test_asymmetric_pools_reject_at_once_and_serve_below(tmp_path, prefill_kv, decode_kv):
    cfg = asym_config(tmp_path, prefill_kv, decode_kv)
    ctx, limits = Topology.load(cfg).admission_plan()
    assert ctx == 256
    run = launch(tmp_path / "run", "--config", str(cfg))
    try:
        # The window was clamped to the smallest pool, and every worker says so.
        for w in ("prefill-0", "decode-0"):
            (m,) = httpx.get(f"{run.worker(w)}/v1/models", timeout=30).json()["data"]
            assert m["max_model_len"] == 256
        # The client endpoint advertises what the deployment serves, which is less (decode's reserve
        # and two pages of slack): it advertised 256 and refused every prompt over 239.
        (m,) = httpx.get(f"{run.url}/v1/models", timeout=30, headers=auth(run.url)).json()["data"]
        assert (m["max_input_tokens"], m["max_model_len"]) == (limits.max_prompt_tokens, limits.max_model_len)
        assert m["max_model_len"] < 256
        served_exactly(
            run.url, m["max_input_tokens"], m["max_model_len"], (limits.max_input_tokens, limits.max_total_tokens)
        )
        # A prompt the bigger role alone would take, the smaller one not: upstream hangs here until the
        # client gives up (30 s). Ours answers in 0.005-0.09 s on an idle machine; the bound leaves
        # room for a loaded CI machine (1.2 s seen once) and still fails on a hang.
        for n in (limits.max_input_tokens, limits.max_input_tokens + 5):
            for stream in (False, True):
                t0 = time.monotonic()
                r = httpx.post(
                    f"{run.url}/generate",
                    json=over_length("/generate", stream, n_prompt=n),
                    timeout=30,
                    headers=auth(run.url),
                )
                assert time.monotonic() - t0 < 5.0 and r.status_code == 400, r.text
                assert f"prompts of at most {limits.max_input_tokens - 1} tokens" in r.text
        out = min(4, limits.max_total_tokens - (limits.max_input_tokens - 1))
        ok = httpx.post(
            f"{run.url}/generate",
            timeout=120,
            headers=auth(run.url),
            json={
                "input_ids": [5] * (limits.max_input_tokens - 1),
                "sampling_params": {"max_new_tokens": out, "ignore_eos": True},
            },
        )
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == out
    finally:
        run.stop()
        assert alive(run.info["all_pids"]) == []


# --- start-up lint -------------------------------------------------------------------------


def test_launcher_refuses_the_incident_configuration(tmp_path):
    cfg = tmp_path / "incident.toml"
    cfg.write_text(set_keys(config_text(), "decode", decode_reserve=16, kv_tokens=256))
    out = subprocess.run(
        [sys.executable, "-m", "glm53_serving.launch", "--config", str(cfg), "--run-dir", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert str(CONTEXT) in out.stderr and "256" in out.stderr and "clamp_context_to_kv = true" in out.stderr
    assert not (tmp_path / "r").exists()  # nothing was started


def run_server_directly(tmp_path, role, extra_env=None, kv=2048, context=CONTEXT):
    """A hand-launched server (no launcher): it must check its own capacity."""
    from tests.e2e.deployment import CONFIG, model_path

    topo = Topology.load(CONFIG, "single" if role == "single" else "pd")
    argv = topo.server_argv(model_path(), 0, role, bootstrap_port=0)
    argv[argv.index("--max-total-tokens") + 1] = str(kv)
    argv[argv.index("--context-length") + 1] = str(context)
    argv[argv.index("--port") + 1] = str(free_port())
    env = {k: v for k, v in os.environ.items() if k != "GLM53_DEPLOYMENT_LIMITS"}
    env.update({k: v for k, v in topo.process_env().items() if k != "GLM53_DEPLOYMENT_LIMITS"}, **(extra_env or {}))
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def test_hand_launched_server_refuses_a_window_larger_than_its_pool(tmp_path):
    out = run_server_directly(tmp_path, "single", kv=256)
    assert out.returncode != 0
    assert "glm53_serving: refusing to start" in out.stderr + out.stdout
    assert (
        f"context window ({CONTEXT} tokens) exceeds this single server's KV capacity (256 tokens)"
        in out.stderr + out.stdout
    )


def test_hand_launched_pd_server_without_the_deployment_limits_refuses(tmp_path):
    out = run_server_directly(tmp_path, "decode")
    assert out.returncode != 0 and "needs the deployment's limits" in out.stderr + out.stdout


def test_pd_server_smaller_than_the_deployment_declared_refuses(tmp_path):
    limits = json.dumps({"max_input_tokens": P, "max_total_tokens": T, "context_length": CONTEXT})
    out = run_server_directly(tmp_path, "decode", {"GLM53_DEPLOYMENT_LIMITS": limits}, kv=T - 110)
    assert out.returncode != 0 and "less than the deployment's limits" in out.stderr + out.stdout


def test_pd_server_started_with_another_context_window_than_its_deployment_refuses(tmp_path):
    """Prefill and decode that disagree on the window accept different requests (a public PD
    benchmark saw 33 of 1,000 hang): a decode started by hand with a larger --context-length than
    the deployment's, with the pool to back it, still refuses."""
    limits = json.dumps({"max_input_tokens": P, "max_total_tokens": T, "context_length": CONTEXT})
    out = run_server_directly(tmp_path, "decode", {"GLM53_DEPLOYMENT_LIMITS": limits}, context=2 * CONTEXT)
    said = out.stderr + out.stdout
    assert out.returncode != 0 and "glm53_serving: refusing to start" in said, said[-2000:]
    assert f"context window ({2 * CONTEXT} tokens) differs from the deployment's ({CONTEXT} tokens" in said


# --- the output limit: GLM-5.3 generates at most 128K tokens per request -------------------------


def test_the_output_limit_is_advertised_enforced_and_fills_in_an_unset_max_tokens(tmp_path):
    """A checkpoint of GLM-5.3 gets max_output_tokens 131,072 by default (tests/unit/test_topology.py);
    here the same limit, at 24 tokens on the tiny model, through the gateway and the real openai
    client: /v1/models says it, one token more is max_tokens_exceeded before any token on every
    endpoint, and a request that sets no max_tokens gets exactly that many with finish_reason
    "length" (SGLang alone would generate to the window: 383 tokens)."""
    import openai

    cap = 24
    cfg = tmp_path / "capped.toml"
    cfg.write_text(set_keys(config_text(), "model", max_output_tokens=cap))
    run = launch(tmp_path / "run", "--config", str(cfg), "--topology", "single")
    try:
        (m,) = httpx.get(f"{run.url}/v1/models", timeout=30, headers=auth(run.url)).json()["data"]
        assert m["max_output_tokens"] == cap and (m["max_input_tokens"], m["max_model_len"]) == (P - 1, T)
        key = run.client_headers()["Authorization"].split()[1]
        client = openai.OpenAI(base_url=f"{run.url}/v1", api_key=key, max_retries=0)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "temperature": 0}
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(**chat, max_tokens=cap + 1, stream=stream)
            err = e.value.body
            assert err["code"] == "max_tokens_exceeded" and err["param"] == "max_tokens", err
            assert err["max_output_tokens"] == cap and err["max_new_tokens"] == cap + 1, err
        worker = httpx.post(  # the worker holds the same limit, whoever reaches it
            f"{run.worker('server')}/generate",
            headers=run.worker_headers(),
            timeout=60,
            json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": cap + 1}},
        )
        assert worker.status_code == 400 and worker.json()["error"]["code"] == "max_tokens_exceeded", worker.text
        full = client.chat.completions.create(**chat, max_tokens=cap, extra_body={"ignore_eos": True})
        unset = client.chat.completions.create(**chat, extra_body={"ignore_eos": True})
        for r in (full, unset):
            assert r.usage.completion_tokens == cap and r.choices[0].finish_reason == "length", r
    finally:
        run.stop()
        assert alive(run.info["all_pids"]) == []


# --- session turns: the history counts --------------------------------------------------------


def test_a_session_turn_is_admitted_whole_with_its_history(single):
    """A turn continues a session: its prompt is the history (earlier prompts and outputs) plus
    its own input. The HTTP process sees only the input; the scheduler admits the whole turn by
    the same formula (found by the isolation suite: 220 tokens of history + 150 new + 40 asked
    were served 410 tokens past the advertised 384). Streamed or not, the turn over the limit is
    the contract 400 before any byte; an unset max_tokens is the rest of the budget; a refused
    turn is not part of the session."""
    url, h = single.url, single.client_headers("demo")
    sid = httpx.post(f"{url}/open_session", json={"capacity_of_str_len": 65536}, headers=h, timeout=30).json()

    def turn(rid, ids, max_new, parent=None, stream=False):
        sp = {"id": sid} if parent is None else {"id": sid, "rid": parent}
        params = {"temperature": 0, "ignore_eos": True} | ({} if max_new is None else {"max_new_tokens": max_new})
        body = {"rid": rid, "input_ids": ids, "stream": stream, "session_params": sp, "sampling_params": params}
        return httpx.post(f"{url}/generate", json=body, headers=h, timeout=300)

    try:
        first = turn(f"s1-{sid}", [7] * 40, 8)
        assert first.status_code == 200 and len(first.json()["output_ids"]) == 8, first.text[:300]
        history = 40 + 8
        new = T - history - 3  # fits alone (new + 4 <= T) but not after the history
        for stream in (False, True):
            r = turn(f"s2-{stream}-{sid}", [9] * new, 4, parent=f"s1-{sid}", stream=stream)
            assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text[:300]
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error", err
            assert f"at most {T} tokens" in err["message"] and f"{history + new} prompt tokens + 4" in err["message"]
        gone = turn(f"s3-{sid}", [9], 1, parent=f"s2-False-{sid}")  # the refused turn is no parent
        assert gone.status_code == 400 and "Invalid request session id" in gone.text, gone.text[:300]
        # the same turn with the budget left: served, and an unset max_tokens gets exactly that
        fits = turn(f"s4-{sid}", [9] * new, 3, parent=f"s1-{sid}")
        assert fits.status_code == 200 and fits.json()["meta_info"]["prompt_tokens"] == T - 3, fits.text[:300]
        rest = turn(f"s5-{sid}", [9] * (new - 10), None, parent=f"s1-{sid}")
        assert rest.status_code == 200, rest.text[:300]
        assert rest.json()["meta_info"]["completion_tokens"] == T - (history + new - 10), rest.text[-300:]
    finally:
        httpx.post(f"{url}/close_session", json={"session_id": sid}, headers=h, timeout=30)

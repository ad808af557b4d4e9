"""Regression tests for requests that killed or wedged upstream SGLang 0.5.23 (measured), named
after what they reproduce. After each rejected request the server serves the next one correctly
(greedy output equal to HF transformers' on the same weights), and every rejection is answered
within REJECT_WITHIN_S."""

import functools
import json
import socket
import time

import httpx
import pytest

from tests.e2e.deployment import MODEL
from tests.e2e.launcher import auth

pytestmark = pytest.mark.e2e

REJECT_WITHIN_S = 2.0
NORMAL_IDS, NORMAL_NEW = [5, 6, 7], 4


@functools.cache
def _hf_greedy() -> list[int]:
    from tests.e2e.deployment import reference_greedy, reference_model

    return reference_greedy(reference_model(), NORMAL_IDS, NORMAL_NEW)


def serves_normally(url, headers=None):
    r = httpx.post(
        f"{url}/generate",
        timeout=120,
        headers=auth(url) if headers is None else headers,
        json={
            "input_ids": NORMAL_IDS,
            "sampling_params": {"max_new_tokens": NORMAL_NEW, "temperature": 0, "ignore_eos": True},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == _hf_greedy()


def rejected(url, path, body, headers, param, status=400):
    """POST, and check the answer is the contract rejection naming `param`, within REJECT_WITHIN_S."""
    t0 = time.monotonic()
    r = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=30)
    elapsed = time.monotonic() - t0
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err
    assert elapsed < REJECT_WITHIN_S, f"{path}: answered in {elapsed:.2f} s"
    return err


@pytest.mark.parametrize("bad", [-1, 512, 10**9], ids=["negative", "vocab_size", "huge"])
def test_out_of_vocabulary_token_id_does_not_kill_the_single_server(single, bad):
    server = single.worker("server")
    r = httpx.post(
        f"{server}/generate",
        timeout=30,
        headers=single.worker_headers(),
        json={"input_ids": [5, bad, 6], "sampling_params": {"max_new_tokens": 2}},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_request_error" and err["param"] == "input_ids" and str(bad) in err["message"]
    assert httpx.get(f"{server}/health", timeout=30, headers=single.worker_headers()).status_code == 200
    serves_normally(single.url, single.client_headers())


@pytest.mark.parametrize("bad", [-1, 512], ids=["negative", "vocab_size"])
def test_out_of_vocabulary_token_id_does_not_hang_pd(pd, bad):
    t0 = time.monotonic()
    r = httpx.post(
        f"{pd.url}/generate",
        timeout=30,
        headers=pd.client_headers(),
        json={"input_ids": [5, bad], "sampling_params": {"max_new_tokens": 2}},
    )
    assert time.monotonic() - t0 < 2.0
    assert r.status_code == 400 and str(bad) in r.json()["error"]["message"]
    for w in ("prefill-0", "decode-0"):
        assert httpx.get(f"{pd.worker(w)}/health", timeout=30, headers=pd.worker_headers()).status_code == 200
    serves_normally(pd.url, pd.client_headers())


@pytest.mark.parametrize("role", ["decode-0", "prefill-0"])
def test_generate_without_bootstrap_fields_does_not_kill_the_pd_server(pd, role):
    worker = pd.worker(role)
    r = httpx.post(
        f"{worker}/generate",
        timeout=30,
        headers=pd.worker_headers(),
        json={"input_ids": [5, 6, 7], "bootstrap_room": 123, "sampling_params": {"max_new_tokens": 2}},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "bootstrap_host" and "routed by its deployment" in err["message"]
    assert httpx.get(f"{worker}/health", timeout=30, headers=pd.worker_headers()).status_code == 200
    serves_normally(pd.url, pd.client_headers())


# --- found by measuring upstream for issue 6 (docs/validation.md) ----------------------------------

ROLES = {"single": ("single", "server"), "prefill": ("pd", "prefill-0"), "decode": ("pd", "decode-0")}
CHAT = [{"role": "user", "content": "hi"}]


def worker_of(request, role):
    run = request.getfixturevalue(ROLES[role][0])
    return run, run.worker(ROLES[role][1])


def healthy_after(run, worker):
    assert httpx.get(f"{worker}/health", timeout=30, headers=run.worker_headers()).status_code == 200
    serves_normally(run.url, run.client_headers())


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 1000}, "logprobs"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 1000},
            "top_logprobs",
        ),
        (
            "/generate",
            {"text": "hi", "return_logprob": True, "top_logprobs_num": 10**6, "sampling_params": {"max_new_tokens": 2}},
            "top_logprobs_num",
        ),
    ],
    ids=["completions", "chat", "generate"],
)
def test_top_logprobs_over_the_vocabulary_do_not_kill_the_server(request, role, path, body, param):
    # upstream: RuntimeError "selected index k out of range" in the sampler takes the scheduler down
    run, worker = worker_of(request, role)
    rejected(worker, path, body, run.worker_headers(), param)
    healthy_after(run, worker)


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_empty_prompt_does_not_kill_the_server(request, role, stream):
    # upstream: a zero-token prefill reaches the MoE layer ("cannot reshape tensor of 0 elements")
    run, worker = worker_of(request, role)
    rejected(worker, "/generate", {"text": "", "stream": stream}, run.worker_headers(), "text")
    healthy_after(run, worker)


def test_batch_with_fewer_sampling_params_than_prompts_is_400_not_500(single):
    # upstream: IndexError in TokenizerManager._init_req_state -> 500
    rejected(
        single.worker("server"),
        "/generate",
        {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]},
        single.worker_headers(),
        "sampling_params",
    )
    serves_normally(single.url, single.client_headers())


@pytest.mark.parametrize("via", ["gateway", "decode-0", "prefill-0"])
@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2, "n": 2}, "n"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 2}}, "sampling_params.n"),
    ],
    ids=["chat", "generate"],
)
def test_n_over_one_does_not_hang_pd(pd, via, path, body, param):
    # upstream through sglang-router: every sample shares one bootstrap room, the client waits
    # for the router's timeout and prefill keeps the other samples queued
    url, headers = (pd.url, pd.client_headers()) if via == "gateway" else (pd.worker(via), pd.worker_headers())
    rejected(url, path, body, headers, param)
    serves_normally(pd.url, pd.client_headers())


def test_n_over_one_is_served_by_a_single_server(single):
    r = httpx.post(
        f"{single.url}/v1/chat/completions",
        timeout=60,
        headers=single.client_headers(),
        json={"model": MODEL, "messages": CHAT, "max_tokens": 2, "n": 3},
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/generate", {"text": "hi", "image_data": "http://127.0.0.1:9/x.png"}, "image_data"),
        ("/generate", {"text": "hi", "sampling_params": {"n": 0}}, "sampling_params.n"),
        ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [-1]}}, "sampling_params.stop_token_ids"),
        (
            "/generate",
            {"text": "hi", "stream": True, "sampling_params": {"temperature": -1}},
            "sampling_params.temperature",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, "n"),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
                    }
                ],
            },
            "messages[0].content[0].type",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "top_p": 1.5, "stream": True}, "top_p"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role",
        ),
    ],
    ids=[
        "image_data",
        "n0",
        "stop_token_ids",
        "stream_temperature",
        "logprobs_negative",
        "completions_n0",
        "input_audio",
        "stream_top_p",
        "role",
    ],
)
def test_requests_upstream_ignored_or_misanswered_are_400_naming_the_field(request, role, path, body, param):
    run, worker = worker_of(request, role)
    rejected(worker, path, body, run.worker_headers(), param)
    healthy_after(run, worker)


@pytest.mark.parametrize("topology", ["single", "pd"])
@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": 2.5}, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 1000, "stream": True}, "logprobs"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ("/generate", {"input_ids": [5, -1]}, "input_ids"),
    ],
    ids=["temperature_negative", "temperature_over_openai", "stop_over_openai", "logprobs_stream", "type", "token_id"],
)
def test_client_endpoint_answers_like_the_workers(single, pd, topology, path, body, param):
    # Through sglang-router (PD) a worker's 400 loses its param and the router has its own bounds
    # and shapes: the gateway answers first, with the same body as a worker.
    run = single if topology == "single" else pd
    rejected(run.url, path, body, run.client_headers(), param)


def _raw_post(url, head: bytes, body_prefix: bytes) -> tuple[float, str, bytes]:
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + body_prefix)
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data and data.rstrip().endswith(b"}"):
                break
    head_text, _, raw = data.partition(b"\r\n\r\n")
    return time.monotonic() - t0, head_text.decode(errors="replace"), raw


@pytest.mark.parametrize("role", ROLES)
def test_body_over_the_worker_limit_is_413_before_it_is_read(request, role):
    run, worker = worker_of(request, role)
    limit = 16 * 1024 * 1024  # topology: twice the gateway's 8 MiB
    auth_line = "".join(f"{k}: {v}\r\n" for k, v in run.worker_headers().items())  # past the tenant guard
    head = (
        f"POST /generate HTTP/1.1\r\nHost: x\r\n{auth_line}Content-Type: application/json\r\n"
        f"Content-Length: {limit + 1}\r\n\r\n"
    ).encode()
    elapsed, status_line, raw = _raw_post(worker, head, b"{")
    assert elapsed < REJECT_WITHIN_S and status_line.startswith("HTTP/1.1 413"), status_line[:200]
    err = json.loads(raw)["error"]
    assert err["code"] == "request_too_large" and err["max_body_bytes"] == limit
    healthy_after(run, worker)


@pytest.mark.parametrize("role", ROLES)
def test_chunked_body_over_the_worker_limit_is_413(request, role):
    run, worker = worker_of(request, role)

    def chunks():
        for _ in range(17):
            yield b"x" * (1024 * 1024)

    t0 = time.monotonic()
    r = httpx.post(f"{worker}/v1/chat/completions", content=chunks(), headers=run.worker_headers(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
    assert time.monotonic() - t0 < REJECT_WITHIN_S
    healthy_after(run, worker)


def test_router_takes_what_the_gateway_forwards_and_refuses_past_its_own_limit(pd):
    router = pd.worker("router")
    # 9 MiB: over the gateway's limit, under the router's and the workers': it reaches a worker,
    # which judges the prompt (over the deployment's length), not the size.
    # (/generate: the router takes no token-id prompt on /v1/completions)
    big = {"input_ids": [7] * (9 * 1024 * 1024 // 2), "sampling_params": {"max_new_tokens": 1}}
    r = httpx.post(f"{router}/generate", json=big, headers=auth(router), timeout=60)
    assert r.status_code == 400 and "prompt" in r.text and "413" not in r.text, r.text[:300]
    r = httpx.post(f"{pd.url}/generate", json=big, headers=pd.client_headers(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["max_body_bytes"] == 8 * 1024 * 1024
    huge = {"input_ids": [7] * (17 * 1024 * 1024 // 2), "sampling_params": {"max_new_tokens": 1}}
    r = httpx.post(f"{router}/generate", json=huge, headers=auth(router), timeout=60)
    assert r.status_code == 413, r.text[:300]
    serves_normally(pd.url, pd.client_headers())


@pytest.mark.parametrize(
    "where,value",
    [("gateway-single", 1000.0), ("server", 1000.0), ("gateway-pd", 2.0), ("prefill-0", 2.0), ("decode-0", 2.0)],
)
def test_an_integral_float_n_is_judged_by_its_value(single, pd, where, value):
    """`n: 1000.0` ran 1,000 completions on a single server; `n: 2.0` reached a PD worker (which
    hangs PD upstream): both are the integer they spell."""
    url = {
        "gateway-single": single.url,
        "server": single.worker("server"),
        "gateway-pd": pd.url,
        "prefill-0": pd.worker("prefill-0"),
        "decode-0": pd.worker("decode-0"),
    }[where]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "n": value}
    if where.startswith(
        ("prefill", "decode")
    ):  # a worker reached with its router's routing fields, as the router sends them
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=1)
    err = rejected(url, "/v1/completions", body, auth(url), "n")
    assert err["code"] == "invalid_request_error" and str(value) in err["message"]
    serves_normally(single.url if "single" in where or where == "server" else pd.url)

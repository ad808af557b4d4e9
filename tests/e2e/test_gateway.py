"""The gateway is every topology's client endpoint: prompt cap with the model's own counting,
413 without reading the body, honest JSON errors, streams and disconnects passed through."""

import json
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm53_serving.gateway.tokens import PromptCounter
from tests.e2e.deployment import MODEL, model_path
from tests.e2e.launcher import auth
from tests.e2e.test_admission import P, T, metric

pytestmark = pytest.mark.e2e

text_s = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
chat_s = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text_s}),
    min_size=1,
    max_size=5,
)


@pytest.fixture(scope="module")
def counter():
    return PromptCounter(model_path())


def count(counter, endpoint: str, body: dict) -> tuple[int, int | None]:
    """(prompt tokens, requested output or None), as the gateway counts a prompt it must encode."""
    prompt, max_new = counter.prompt_of(endpoint, body)
    return (prompt if isinstance(prompt, int) else counter.encode(prompt)), max_new


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=chat_s)
def test_gateway_counts_prompts_exactly_as_the_server_does(single, counter, chat):
    r = httpx.post(
        f"{single.worker('server')}/v1/chat/completions",
        timeout=60,
        headers=auth(single.worker("server")),
        json={"model": MODEL, "messages": chat, "max_tokens": 1},
    )
    assert r.status_code == 200, r.text
    assert count(counter, "/v1/chat/completions", {"messages": chat}) == (r.json()["usage"]["prompt_tokens"], None)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=text_s.filter(bool))
def test_gateway_counts_completion_prompts_exactly_as_the_server_does(single, counter, text):
    r = httpx.post(
        f"{single.worker('server')}/v1/completions",
        timeout=60,
        headers=auth(single.worker("server")),
        json={"model": MODEL, "prompt": text, "max_tokens": 1},
    )
    assert r.status_code == 200, r.text
    assert count(counter, "/v1/completions", {"prompt": text})[0] == r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("topology", ["single", "pd"])
def test_20mb_body_is_413_within_2s_without_reading_it(single, pd, topology):
    run = single if topology == "single" else pd
    host, port = run.url.removeprefix("http://").split(":")
    body_len = 20 * 1024 * 1024
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        # Announce 20 MB but send only the headers and 64 KiB: the answer must not wait for the rest.
        s.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: {run.client_headers()['Authorization']}\r\n"
            f"Content-Length: {body_len}\r\n\r\n".encode()
            + b"{"
            + b" " * 65535
        )
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    assert time.monotonic() - t0 < 2.0
    head, _, raw = data.decode(errors="replace").partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413"), head[:200]
    body = json.loads(raw)
    assert body["error"]["code"] == "request_too_large" and body["error"]["max_body_bytes"] == 8 * 1024 * 1024


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def test_chunked_body_over_the_limit_is_413(single):
    def chunks():
        for _ in range(20):
            yield b"x" * (1024 * 1024)

    r = httpx.post(f"{single.url}/generate", content=chunks(), timeout=30, headers=auth(single.url))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("topology", ["single", "pd"])
def test_models_reports_the_deployment_window(single, pd, topology):
    run = single if topology == "single" else pd
    (m,) = httpx.get(f"{run.url}/v1/models", timeout=30).json()["data"]
    # The largest prompt + output and the largest prompt actually served (test_admission sends them).
    assert (m["id"], m["max_model_len"], m["max_input_tokens"]) == (MODEL, T, P - 1)


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_worker_errors_reach_the_client_as_valid_json_with_their_status(pd, stream):
    # A request the gateway forwards (it does not judge sampling parameters) and the workers reject:
    # through sglang-router alone the streaming body arrives cut (invalid JSON).
    r = httpx.post(
        f"{pd.url}/v1/chat/completions",
        timeout=30,
        headers=auth(pd.url),
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": -1,
            "stream": stream,
        },
    )
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]  # valid JSON, whatever the router did to the body
    assert isinstance(err["message"], str) and err["message"]


def test_invalid_json_is_a_contract_400(single):
    r = httpx.post(f"{single.url}/v1/chat/completions", content=b"{not json", timeout=30, headers=auth(single.url))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_error"


@pytest.mark.parametrize("topology", ["single", "pd"])
def test_stream_passes_through_and_disconnect_frees_the_request(single, pd, topology):
    run = single if topology == "single" else pd
    worker = single.worker("server") if topology == "single" else pd.worker("decode-0")
    # The disconnect races the request's end (480 tokens take 1-2 s here on glm53-tiny GQA): a try that the
    # request won anyway is retried; one that ends aborted is what must happen.
    for _ in range(3):
        before = metric(worker, "sglang:generation_tokens_histogram_sum")
        with httpx.stream(
            "POST",
            f"{run.url}/generate",
            timeout=60,
            headers=auth(run.url),
            json={
                "input_ids": [7] * 20,
                "stream": True,
                "sampling_params": {"max_new_tokens": T - 20, "ignore_eos": True, "temperature": 0},
            },
        ) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events += 1
                    if events == 3:
                        break  # leave mid-stream: closing the connection is the disconnect
        assert events == 3
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if metric(worker, "sglang:num_running_reqs") == 0:
                break
            time.sleep(0.5)
        assert metric(worker, "sglang:num_running_reqs") == 0
        time.sleep(1.0)
        generated = metric(worker, "sglang:generation_tokens_histogram_sum") - before
        if generated < 480:
            break
    assert generated < 480  # aborted, not run to completion

"""API fuzzing of every server role with Schemathesis (SGLang's own /openapi.json) and hand-written
Hypothesis strategies for what the schema does not describe.

For every generated request, against a single server, a PD deployment through its router (so that
requests carry real routing and reach the PD schedulers; the generated valid ones must be served)
and through its gateway, and the prefill and decode servers reached directly: no 5xx, no dropped
connection, an answer within REQUEST_TIMEOUT_S, and every 4xx a JSON error body, in the contract's
shape with a contract code wherever our layers answer (the router rewrites PD error bodies, the
gateway restores them); afterwards the deployment still serves a normal request correctly. Only generation endpoints and harmless GETs are fuzzed:
control endpoints (/shutdown, /flush_cache, /update_weights*, /abort_request, ...) are not.

Bounded for CI (about a minute of requests per role on 2 cores): FUZZ_EXAMPLES per operation and
mode, generation phase only (no shrinking: a failure prints its request), no example database.
"""

import json
import os
import time

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from glm53_serving.errors import CONTRACT
from tests.e2e.deployment import MODEL
from tests.e2e.test_robustness import serves_normally

pytestmark = pytest.mark.e2e

FUZZ_EXAMPLES = int(os.environ.get("GLM53_FUZZ_EXAMPLES", "15"))
REQUEST_TIMEOUT_S = 30.0
MAX_OUTPUT_TOKENS = 8  # generated requests that are valid still finish quickly on CPU
# role -> (deployment, process whose URL is fuzzed (None: the client URL), whether its 4xx are ours)
ROLES = {
    "single": ("single", "server", True),
    "pd-router": ("pd", "router", False),
    "pd-gateway": ("pd", None, True),
    "prefill": ("pd", "prefill-0", True),
    "decode": ("pd", "decode-0", True),
}
SCHEMA_ROLES = ("single", "pd-router", "pd-gateway")  # prefill and decode alone serve nothing unrouted
GENERATION = ("/generate", "/v1/completions", "/v1/chat/completions")
# Schemathesis' negative mode on the OpenAI request models takes minutes per handful of
# examples to generate (measured: 270 s for 15); the hand-written strategies below cover them.
OPERATIONS = [
    ("/generate", GenerationMode.POSITIVE),
    ("/generate", GenerationMode.NEGATIVE),
    ("/v1/completions", GenerationMode.POSITIVE),
    ("/v1/chat/completions", GenerationMode.POSITIVE),
]
HARMLESS_GETS = ("/health", "/v1/models", "/model_info", "/server_info")

FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


def target(request, role):
    """(deployment, URL, headers a caller there sends, the URL of a server whose schema applies)."""
    deployment, process, _ = ROLES[role]
    run = request.getfixturevalue(deployment)
    url = run.worker(process) if process else run.url
    headers = run.worker_headers() if process else run.client_headers()
    schema_url = run.worker("server" if deployment == "single" else "prefill-0")
    return run, url, headers, schema_url


@pytest.fixture(scope="module")
def schemas():
    return {}


def schema_of(schemas, url, headers):
    if url not in schemas:
        schemas[url] = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers, timeout=30)
    return schemas[url]


def bounded(path, body):
    """Keep a generated request's output short where it asks for a valid amount (or none)."""
    if not isinstance(body, dict):
        return body
    params = body.get("sampling_params")
    for holder, key in ((body, "max_tokens"), (body, "max_completion_tokens"), (params, "max_new_tokens")):
        if isinstance(holder, dict) and isinstance(holder.get(key), int) and holder[key] > MAX_OUTPUT_TOKENS:
            holder[key] = MAX_OUTPUT_TOKENS
    if path != "/generate" and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_OUTPUT_TOKENS  # /generate ignores it as an unknown field
    if isinstance(params, dict) and "max_new_tokens" not in params:
        params["max_new_tokens"] = MAX_OUTPUT_TOKENS
    return body


def answered_soundly(send, what: str, seen: dict, ours: bool = True) -> None:
    """Send one request (`send()` -> response) and check its answer; count it in `seen`."""
    t0 = time.monotonic()
    try:
        r = send()
    except (requests.RequestException, httpx.HTTPError) as e:  # a dropped connection or a hang
        pytest.fail(f"{what}: {type(e).__name__}: {e}")
    seen[r.status_code] = seen.get(r.status_code, 0) + 1
    assert_answer_is_sound(r.status_code, r.headers, r.content, time.monotonic() - t0, what, ours)


def assert_answer_is_sound(status: int, headers, content: bytes, elapsed: float, what: str, ours: bool = True):
    assert status < 500, f"{what}: {status} {content[:500]!r}"
    assert elapsed < REQUEST_TIMEOUT_S, f"{what}: answered after {elapsed:.1f} s"
    if not ours:  # the router answers its own 4xx in text/plain; the gateway is the client's endpoint
        return
    if 400 <= status < 500:
        ctype = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
        ctype = ctype[0] if isinstance(ctype, list) else ctype  # Schemathesis' responses hold lists
        assert ctype.startswith("application/json"), f"{what}: {status} {content[:300]!r}"
        err = json.loads(content)["error"]
        assert isinstance(err["message"], str) and err["message"], what
        assert err["type"] == "invalid_request_error" and err["code"] in CONTRACT and "param" in err, (what, err)


@pytest.mark.parametrize("role", SCHEMA_ROLES)
@pytest.mark.parametrize("path,mode", OPERATIONS, ids=lambda x: str(x).strip("/").replace("/", "_"))
def test_schemathesis_generation_endpoints(request, schemas, role, path, mode):
    run, url, headers, schema_url = target(request, role)
    operation = schema_of(schemas, schema_url, run.worker_headers())[path]["POST"]
    seen = {}

    @FUZZ
    @given(case=operation.as_strategy(mode))
    def one(case):
        case.body = bounded(path, case.body)
        answered_soundly(
            lambda: case.call(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S),
            f"{path} {case.body!r:.300}",
            seen,
            ROLES[role][2],
        )

    one()
    print(f"{role} {path} {mode.value}: {sum(seen.values())} requests, statuses {seen}")
    serves_normally(run.url, run.client_headers())


@pytest.mark.parametrize("role", ("single", "prefill", "decode"))
def test_schemathesis_harmless_gets(request, schemas, role):
    run, url, _, _ = target(request, role)
    schema = schema_of(schemas, url, run.worker_headers())
    for path in HARMLESS_GETS:

        @settings(FUZZ, max_examples=5)
        @given(case=schema[path]["GET"].as_strategy())
        def one(case):
            t0 = time.monotonic()
            r = case.call(base_url=url, headers=run.worker_headers(), timeout=REQUEST_TIMEOUT_S)
            assert r.status_code < 500 and time.monotonic() - t0 < REQUEST_TIMEOUT_S, (
                path,
                r.status_code,
                r.text[:300],
            )

        one()


# --- valid requests with random sampling, through to every scheduler ----------------------------

# What the schema's "positive" examples almost never are: valid for this deployment (15 of 15 are
# refused by validation), so they never reach a scheduler. These are valid by construction, with
# every sampling parameter drawn from its whole legal domain, so the PD schedulers (reached through
# the router, with real routing) and the single server's are fuzzed.
sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.one_of(st.just(-1), st.integers(1, 512)),
        "min_p": st.floats(0, 1),
        "frequency_penalty": st.floats(-2, 2),
        "presence_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.01, 2),
        "stop": st.lists(st.text("abcdefgh ", min_size=1, max_size=3), max_size=4),
        "seed": st.integers(0, 2**31),
        "logit_bias": st.dictionaries(st.integers(0, 511).map(str), st.floats(-100, 100), max_size=4),
    },
)


@st.composite
def valid_request(draw):
    path = draw(st.sampled_from(GENERATION))
    n_new = draw(st.integers(1, MAX_OUTPUT_TOKENS))
    params = draw(sampling)
    stream = draw(st.booleans())
    if path == "/generate":
        prompt = draw(
            st.one_of(st.lists(st.integers(0, 511), min_size=1, max_size=300), st.text(min_size=1, max_size=200))
        )
        sp = {k: v for k, v in params.items() if k != "seed" and k != "logit_bias"}
        sp.update(max_new_tokens=n_new, ignore_eos=draw(st.booleans()))
        key = "input_ids" if isinstance(prompt, list) else "text"
        return path, {key: prompt, "sampling_params": sp, "stream": stream}
    body = {"model": MODEL, "max_tokens": n_new, "stream": stream, **params}
    if path == "/v1/completions":
        body["prompt"] = draw(st.text(min_size=1, max_size=200))
        body["logprobs"] = draw(st.none() | st.integers(0, 5))
    else:
        body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=200))}]
    return path, body


@pytest.mark.parametrize("role", ("single", "pd-router", "pd-gateway"))
def test_valid_requests_with_random_sampling_are_served_by_every_scheduler(request, role):
    run, url, headers, _ = target(request, role)
    seen = {}
    with httpx.Client(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S) as client:

        @settings(FUZZ, max_examples=2 * FUZZ_EXAMPLES)
        @given(req=valid_request())
        def one(req):
            path, body = req
            r = client.post(path, json=body)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code == 200, f"{path} {body!r:.300}: {r.status_code} {r.text[:300]}"
            if not body.get("stream"):
                usage = r.json().get("usage") or r.json().get("meta_info")
                assert usage["completion_tokens"] >= 1, r.text[:300]
            else:
                events = sse_events(r.text)
                assert events and events[-1] == "[DONE]", r.text[-300:]
                # Every event is a JSON chunk and none is an error (the model may well write " error").
                assert not [e for e in events[:-1] if "error" in json.loads(e)], r.text[-300:]

        one()
    print(f"{role} valid requests: {sum(seen.values())}, statuses {seen}")
    serves_normally(run.url, run.client_headers())


def sse_events(text: str) -> list[str]:
    # SSE lines end at CR or LF only (not at str.splitlines()'s U+2028, U+0085, ...: JSON leaves
    # those unescaped inside a token's text, and a byte-level BPE token can hold one).
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return [line.removeprefix("data:").strip() for line in lines if line.startswith("data:")]


# --- what the schema does not describe ----------------------------------------------------------

token_id = st.one_of(
    st.integers(0, 511), st.integers(-(2**63), -1), st.integers(512, 2**63 - 1), st.integers(2**63, 2**80)
)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def _json(body) -> bytes:
    return json.dumps(body).encode()


@st.composite
def abusive_request(draw):
    """(path, raw body, content type): malformed in the ways the OpenAPI schema cannot express."""
    path = draw(st.sampled_from(GENERATION))
    field = {"/generate": "input_ids", "/v1/completions": "prompt", "/v1/chat/completions": "messages"}[path]
    base = (
        {"model": MODEL, "max_tokens": 2, "sampling_params": {"max_new_tokens": 2}}
        if path != "/generate"
        else {"sampling_params": {"max_new_tokens": 2}}
    )
    kind = draw(
        st.sampled_from(
            [
                "token_ids",
                "nested",
                "huge_array",
                "bad_utf8",
                "odd_encoding",
                "content_type",
                "random_json",
                "random_field",
                "media",
            ]
        )
    )
    ctype = "application/json"
    if kind == "token_ids":
        ids = draw(st.lists(token_id, min_size=0, max_size=20))
        prompt = ids if path != "/v1/chat/completions" else [{"role": "user", "content": ids}]
        raw = _json({**base, field: prompt})
    elif kind == "nested":
        depth = draw(st.integers(100, 20_000))
        raw = _json(base)[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "huge_array":
        n = draw(st.integers(10_000, 200_000))
        raw = _json(base)[:-1] + f', "{field}": [{",".join(["7"] * n)}]}}'.encode()
    elif kind == "bad_utf8":
        junk = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"]))
        raw = _json({**base, "text": "hi", "prompt": "hi"})[:-1] + b', "s": "' + junk + b'"}'
    elif kind == "odd_encoding":
        enc = draw(st.sampled_from(["utf-16", "utf-32", "utf-8-sig", "latin-1"]))
        raw = json.dumps(
            {**base, "text": "h\u00e9", "prompt": "h\u00e9", "messages": [{"role": "user", "content": "h\u00e9"}]},
            ensure_ascii=False,
        ).encode(enc)
    elif kind == "content_type":
        ctype = draw(
            st.sampled_from(
                [
                    "text/plain",
                    "application/x-www-form-urlencoded",
                    "multipart/form-data",
                    "application/xml",
                    "application/json; charset=utf-16",
                ]
            )
        )
        raw = _json({**base, "text": "hi", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]})
    elif kind == "random_json":
        raw = _json(draw(json_value))
    elif kind == "random_field":
        raw = _json(
            {
                **base,
                field: draw(json_value),
                draw(
                    st.sampled_from(
                        [
                            "temperature",
                            "top_p",
                            "top_k",
                            "n",
                            "stop",
                            "logprobs",
                            "top_logprobs",
                            "seed",
                            "stream",
                            "logit_bias",
                            "top_logprobs_num",
                            "return_logprob",
                        ]
                    )
                ): draw(json_value),
            }
        )
    else:
        media = draw(st.sampled_from(["image_data", "audio_data", "video_data", "input_embeds"]))
        raw = _json(
            {
                **base,
                "text": "hi",
                "prompt": "hi",
                media: draw(json_value) or "x",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": draw(
                                    st.sampled_from(["image_url", "input_audio", "video_url", "audio_url", "file"])
                                ),
                                "x": 1,
                            }
                        ],
                    }
                ],
            }
        )
    return path, raw, ctype


@pytest.mark.parametrize("role", ("single", "pd-router", "prefill", "decode"))
def test_hand_written_abuse_is_answered_and_survived(request, role):
    run, url, headers, _ = target(request, role)
    seen = {}
    with httpx.Client(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S) as client:

        @FUZZ
        @given(req=abusive_request())
        def one(req):
            path, raw, ctype = req
            answered_soundly(
                lambda: client.post(path, content=raw, headers={"content-type": ctype}),
                f"{path} {raw[:300]!r}",
                seen,
                ROLES[role][2],
            )

        one()
    print(f"{role} hand-written: {sum(seen.values())} requests, statuses {seen}")
    serves_normally(run.url, run.client_headers())

"""Request validation as pure functions, against the pinned SGLang's own models and SamplingParams."""

import json

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from glm53_serving import validation as v
from glm53_serving.errors import ClientError
from glm53_serving.models import tiny

VOCAB = 512
VERIFY = v.sglang_verify(AutoTokenizer.from_pretrained(tiny.ensure()))
MSG = [{"role": "user", "content": "hi"}]


def with_model(endpoint, body):
    """OpenAI bodies name the model (a test of another field leaves it as a client sends it)."""
    if endpoint != v.GENERATE and isinstance(body, dict) and "model" not in body:
        return {"model": "m", **body}
    return body


def check(endpoint, body, text_only=True):
    v.check_request(endpoint, with_model(endpoint, body), vocab_size=VOCAB, text_only=text_only, verify=VERIFY)


def rejected(endpoint, body, **kw) -> ClientError:
    with pytest.raises(ClientError) as e:
        check(endpoint, body, **kw)
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"
    return e.value


@pytest.mark.parametrize(
    "endpoint,body",
    [
        (
            v.GENERATE,
            {
                "text": "hi",
                "sampling_params": {
                    "max_new_tokens": 4,
                    "temperature": 0.7,
                    "top_p": 0.9,
                    "top_k": 5,
                    "stop": ["x"],
                    "stop_token_ids": [3],
                    "n": 2,
                    "sampling_seed": 7,
                },
            },
        ),
        (v.GENERATE, {"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]}),
        (v.GENERATE, {"text": "hi", "return_logprob": True, "top_logprobs_num": 20}),
        (
            v.COMPLETIONS,
            {"model": "m", "prompt": "hi", "max_tokens": 4, "logprobs": 5, "n": 2, "best_of": 3, "seed": 1},
        ),
        (
            v.CHAT,
            {
                "model": "m",
                "messages": MSG,
                "max_completion_tokens": 4,
                "logprobs": True,
                "top_logprobs": 20,
                "temperature": 0,
                "frequency_penalty": -2,
                "presence_penalty": 2,
                "stop": "x",
            },
        ),
        (v.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    ],
)
def test_valid_requests_pass(endpoint, body):
    check(endpoint, body)


@pytest.mark.parametrize(
    "endpoint,body,param",
    [
        # SGLang's SamplingParams.verify, attributed to the field as the client named it
        (v.GENERATE, {"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        (v.GENERATE, {"text": "hi", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        (v.GENERATE, {"text": "hi", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        (v.GENERATE, {"text": "hi", "sampling_params": {"min_p": 2}}, "sampling_params.min_p"),
        (
            v.GENERATE,
            {"text": "hi", "sampling_params": {"repetition_penalty": 5}},
            "sampling_params.repetition_penalty",
        ),
        (
            v.GENERATE,
            {"text": "hi", "sampling_params": {"max_new_tokens": 3, "min_new_tokens": 5}},
            "sampling_params.min_new_tokens",
        ),
        (v.GENERATE, {"text": "hi", "sampling_params": {"logit_bias": {"x": 1}}}, "sampling_params.logit_bias"),
        (v.GENERATE, {"text": "hi", "sampling_params": {"stop": ["a"] * 40}}, "sampling_params.stop"),
        (v.GENERATE, {"text": "hi", "sampling_params": {"stop_token_ids": [-1]}}, "sampling_params.stop_token_ids"),
        (
            v.GENERATE,
            {"text": "hi", "sampling_params": [{"top_p": 0.5}, {"top_p": 7}], "input_ids": None} | {"text": ["a", "b"]},
            "sampling_params[1].top_p",
        ),
        (v.COMPLETIONS, {"prompt": "hi", "temperature": -1}, "temperature"),
        (v.COMPLETIONS, {"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty"),
        (v.COMPLETIONS, {"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
        (v.CHAT, {"messages": MSG, "max_completion_tokens": -5}, "max_completion_tokens"),
        (v.CHAT, {"messages": MSG, "max_tokens": -1}, "max_tokens"),
        (v.CHAT, {"messages": MSG, "top_p": 1.5}, "top_p"),
        (v.CHAT, {"messages": MSG, "stop_token_ids": [VOCAB]}, "stop_token_ids"),
        # bounds SGLang lacks
        (v.GENERATE, {"text": "hi", "sampling_params": {"n": 0}}, "sampling_params.n"),
        (v.GENERATE, {"text": "hi", "return_logprob": True, "top_logprobs_num": 10**6}, "top_logprobs_num"),
        (v.GENERATE, {"text": "hi", "top_logprobs_num": -1}, "top_logprobs_num"),
        (v.GENERATE, {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]}, "sampling_params"),
        (v.GENERATE, {"text": "hi", "input_ids": [1]}, "input_ids"),
        (v.COMPLETIONS, {"prompt": "hi", "n": 0}, "n"),
        (v.COMPLETIONS, {"prompt": "hi", "n": 1000}, "n"),
        (v.COMPLETIONS, {"prompt": "hi", "logprobs": 1000}, "logprobs"),
        (v.COMPLETIONS, {"prompt": "hi", "logprobs": -1}, "logprobs"),
        (v.COMPLETIONS, {"prompt": "hi", "best_of": 0}, "best_of"),
        (v.CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 1000}, "top_logprobs"),
        (v.CHAT, {"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
        # schema (SGLang's pydantic models and /generate contract), the param without pydantic's union tags
        (v.CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (v.CHAT, {"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, "messages[0].content[0].type"),
        (v.CHAT, {"messages": "hi"}, "messages"),
        (v.CHAT, {"model": "m"}, "messages"),
        (v.CHAT, {"messages": MSG, "temperature": "hot"}, "temperature"),
        (v.COMPLETIONS, {"prompt": "hi", "seed": 2**70}, "seed"),
        (v.GENERATE, {"text": 5}, "text"),
        (v.GENERATE, {"input_ids": [[[1]]]}, "input_ids"),
        (v.GENERATE, {"text": "hi", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        (v.GENERATE, {"text": "hi", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        (v.GENERATE, {"text": "hi", "stream": "yes"}, "stream"),
        # prompts: present, not empty, ids in the vocabulary, named as the endpoint names them
        (v.GENERATE, {"sampling_params": {"max_new_tokens": 1}}, "text"),
        (v.GENERATE, {"input_ids": []}, "input_ids"),
        (v.GENERATE, {"input_ids": [5, -1]}, "input_ids"),
        (v.GENERATE, {"input_ids": [[5], [VOCAB]]}, "input_ids"),
        (v.COMPLETIONS, {"prompt": ""}, "prompt"),
        (v.COMPLETIONS, {"prompt": [5, 10**9]}, "prompt"),
        (v.CHAT, {"messages": []}, "messages"),
        # other modalities on a text-only model
        (v.GENERATE, {"text": "hi", "image_data": "http://x/y.png"}, "image_data"),
        (v.GENERATE, {"text": "hi", "audio_data": "http://x/y.wav"}, "audio_data"),
        (v.GENERATE, {"text": "hi", "video_data": "http://x/y.mp4"}, "video_data"),
        (
            v.CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
        ),
        (
            v.CHAT,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a"},
                            {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
                        ],
                    }
                ]
            },
            "messages[0].content[1].type",
        ),
    ],
)
def test_invalid_requests_name_the_field(endpoint, body, param):
    e = rejected(endpoint, body)
    assert e.param == param, e.message
    assert e.message and "File " not in e.message  # no server paths or tracebacks


def test_media_accepted_by_a_multimodal_model():
    check(v.GENERATE, {"text": "hi", "image_data": "http://x/y.png"}, text_only=False)


@pytest.mark.parametrize(
    "raw,ctype,needle",
    [
        (b"{not json", "application/json", "not valid JSON"),
        (b'{"text": "\xff"}', "application/json", "not valid UTF-8"),
        ('{"text": "hi"}'.encode("utf-16"), "application/json", "not valid UTF-8"),
        (b'{"text": "\\ud800"}', "application/json", "not valid JSON"),
        (b'{"text": "hi", "x": NaN}', "application/json", "not valid JSON"),
        (b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "application/json", "not valid JSON"),
        (b"[1, 2]", "application/json", "must be a JSON object"),
        (b"", None, "not valid JSON"),
        (b'{"text": "hi"}', "text/plain", "Content-Type"),
    ],
)
def test_bodies_that_are_not_a_json_object_are_400(raw, ctype, needle):
    with pytest.raises(ClientError) as e:
        v.parse_body(raw, ctype)
    assert e.value.status == 400 and needle in e.value.message and e.value.param is None


def test_json_body_with_charset_parses():
    assert v.parse_body(b'{"text": "h\xc3\xa9"}', "application/json; charset=utf-8") == {"text": "hé"}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(sorted(v.OPENAI_SAMPLING)),
        st.one_of(st.none(), st.integers(-(10**6), 10**6), st.floats(allow_nan=False, width=32), st.text(max_size=3)),
        max_size=4,
    )
)
def test_chat_sampling_never_raises_anything_but_a_client_error(fields):
    body = {"messages": MSG, **fields}
    try:
        check(v.CHAT, body)
    except ClientError as e:
        assert e.status == 400 and (e.param is None or e.param in fields or e.param.split(".")[0] in fields), (
            e.param,
            fields,
        )
        json.dumps(e.body())


def test_tokenized_checks_name_the_endpoint_field():
    def param(ids, top, endpoint, token_ids=False):
        with pytest.raises(ClientError) as e:
            v.check_tokenized(ids, top, VOCAB, endpoint, v.prompt_param(endpoint, token_ids))
        return e.value.param

    assert param([], None, v.COMPLETIONS) == "prompt"
    assert param([], None, v.CHAT) == "messages"
    assert param([], None, v.GENERATE) == "text"
    assert param([], None, v.GENERATE, token_ids=True) == "input_ids"
    assert param([1], 1000, v.CHAT) == "top_logprobs"
    v.check_tokenized([1], 5, VOCAB, v.GENERATE, "text")
    v.check_tokenized(None, None, VOCAB, None, "text")


@pytest.mark.parametrize(
    "loc,param",
    [
        (("body", "messages", 0, "function-after[f(), ChatCompletionMessageGenericParam]", "role"), "messages[0].role"),
        (("text", "list[str]"), "text"),
        (("sampling_params", "list[dict[str,any]]", 0), "sampling_params[0]"),
        ((), None),
    ],
)
def test_pydantic_locations_become_openai_params(loc, param):
    assert v.param_of(loc) == param


@pytest.mark.parametrize(
    "endpoint,body,param",
    [
        (v.CHAT, {"messages": MSG, "temperature": 2.5}, "temperature"),
        (v.COMPLETIONS, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_openai_bounds_the_router_enforces_are_enforced_everywhere(endpoint, body, param):
    assert rejected(endpoint, body).param == param


@pytest.mark.parametrize(
    "endpoint,body,param",
    [
        (v.CHAT, {"messages": MSG, "n": 2}, "n"),
        (v.GENERATE, {"text": "hi", "sampling_params": {"n": 2}}, "sampling_params.n"),
        (v.COMPLETIONS, {"prompt": "hi", "best_of": 2}, "best_of"),
    ],
)
def test_pd_takes_one_sample_per_request(endpoint, body, param):
    check(endpoint, body)  # fine on a single server
    with pytest.raises(ClientError) as e:
        v.check_request(
            endpoint, with_model(endpoint, body), vocab_size=VOCAB, text_only=True, verify=VERIFY, max_n=v.MAX_N_PD
        )
    assert e.value.param == param


OK_MSG = {"role": "user", "content": "x"}


N = v.MAX_ITEMS - 64  # elements after the sample, within the list bound


@pytest.mark.parametrize(
    "endpoint,body,param",
    [
        # each would otherwise cost seconds of the event loop in pydantic's error reporting
        (v.CHAT, {"messages": [7] * N}, "messages[0]"),
        (v.CHAT, {"messages": [OK_MSG] * 64 + [{"role": "user", "content": 5}] * N}, "messages[64].content"),
        (v.CHAT, {"messages": [OK_MSG] * 64 + [{"content": "x"}] * N}, "messages[64].role"),
        (
            v.CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 64 + [{"type": "text"}] * N}]},
            None,
        ),
        (v.COMPLETIONS, {"prompt": [1] * 64 + [1.5] * N}, "prompt[64]"),
        (v.GENERATE, {"text": ["a"] * 64 + [7] * N}, "text[64]"),
        # values whose validity is not their type's get past the sample: the list bound caps them
        (v.CHAT, {"messages": [OK_MSG], "stop_token_ids": ["1"] * 64 + ["a"] * N}, "stop_token_ids[64]"),
        # and past the bound, the length is the error, found before any element is looked at
        (
            v.CHAT,
            {"messages": [OK_MSG], "stop_token_ids": ["1"] * 64 + ["a"] * 1_600_000},
            "stop_token_ids",
        ),  # was 11 s
        (v.CHAT, {"messages": [OK_MSG] * 250_000}, "messages"),
        (
            v.CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 300_000}]},
            "messages[0].content",
        ),
        (v.COMPLETIONS, {"prompt": ["a"] * 1_600_000}, "prompt"),  # was valid: a 1.6-million-prompt batch
        (v.GENERATE, {"text": ["a"] * 64 + [7] * 200_000}, "text"),
        (v.CHAT, {"messages": [OK_MSG], "logit_bias": {str(i): 1 for i in range(500_000)}}, "logit_bias"),
        (v.CHAT, {"messages": [OK_MSG], **{f"x{i}": 1 for i in range(v.MAX_ITEMS)}}, None),
    ],
)
def test_huge_malformed_lists_are_rejected_within_the_rejection_bound(endpoint, body, param):
    import time

    for ep in v.GENERATION:
        v._model(ep)  # SGLang's models imported and built before timing
    t0 = time.monotonic()
    e = rejected(endpoint, body)
    # without the bounds: 1 to 31 s; with them, 0.01 to 0.2 s on an idle 2-core machine
    assert time.monotonic() - t0 < 3.0 and e.param == param, e.message


def test_lists_of_token_ids_are_left_to_the_length_limit_and_other_lists_are_bounded():
    check(v.GENERATE, {"input_ids": [7] * (3 * v.MAX_ITEMS), "sampling_params": {"max_new_tokens": 1}})
    check(v.COMPLETIONS, {"prompt": [[1] * 250] * 4000, "max_tokens": 1})
    check(v.COMPLETIONS, {"prompt": ["a"] * v.MAX_ITEMS, "max_tokens": 1})
    check(v.CHAT, {"messages": MSG, "logit_bias": {str(i): 1 for i in range(VOCAB)}})
    e = rejected(v.COMPLETIONS, {"prompt": ["a"] * (v.MAX_ITEMS + 1)})
    assert e.param == "prompt" and f"at most {v.MAX_ITEMS}" in e.message


def test_a_long_valid_token_list_passes_quickly():
    import time

    v._model(v.GENERATE)
    t0 = time.monotonic()
    v.check_schema(v.GENERATE, {"input_ids": [7] * 1_000_000})
    assert time.monotonic() - t0 < 3.0


@pytest.mark.parametrize("depth", [65, 500, 1000])
def test_deep_nesting_within_json_limits_is_400_not_a_recursion_error(depth):
    body = {"messages": MSG, "x": orjson.loads("[" * depth + "]" * depth)}
    e = rejected(v.CHAT, body)
    assert "deeper than 64" in e.message


def test_free_form_json_and_mixed_numbers_are_not_held_to_one_kind():
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"enum": [1, "a", None, 2.5]}}}},
    }
    check(v.CHAT, {"messages": MSG, "tools": [tool]})
    check(v.CHAT, {"messages": MSG, "logit_bias": {"3": 1, "4": 0.5}, "stop": ["a"]})
    assert rejected(v.CHAT, {"messages": MSG, "stop": ["a", 1]}).param == "stop[1]"


# Every bounded integer field, judged by its value whatever JSON number form it comes in (the
# schema turns 2.0 into 2 for SGLang): in range as a float passes, out of range as a float, a huge
# float or a boolean is a 400 naming the field. The gateway and every worker run these checks.
BOUNDED = [
    (v.COMPLETIONS, {"prompt": "hi"}, "n", 2, v.MAX_N + 1),
    (v.CHAT, {"messages": MSG}, "n", 2, v.MAX_N + 1),
    (v.COMPLETIONS, {"prompt": "hi"}, "best_of", 2, v.MAX_N + 1),
    (v.COMPLETIONS, {"prompt": "hi"}, "logprobs", 2, v.MAX_TOP_LOGPROBS + 1),
    (v.CHAT, {"messages": MSG, "logprobs": True}, "top_logprobs", 2, v.MAX_TOP_LOGPROBS + 1),
]


@pytest.mark.parametrize("endpoint,base,name,inside,outside", BOUNDED, ids=lambda x: x if isinstance(x, str) else None)
def test_integer_bounds_hold_for_every_json_number_form(endpoint, base, name, inside, outside):
    check(endpoint, {**base, name: float(inside)})  # 2.0 is the integer 2
    for value in (float(outside), 1e18, 1e300):
        assert rejected(endpoint, {**base, name: value}).param == name, value
    assert rejected(endpoint, {**base, name: True}).param == name


@pytest.mark.parametrize(
    "endpoint,base", [(v.COMPLETIONS, {"model": "m", "prompt": "hi"}), (v.CHAT, {"model": "m", "messages": MSG})]
)
def test_a_pd_worker_refuses_n_above_one_in_any_form(endpoint, base):
    for value in (2, 2.0, 1e300, True):
        with pytest.raises(ClientError) as e:
            v.check_request(
                endpoint, {**base, "n": value}, vocab_size=VOCAB, text_only=True, verify=VERIFY, max_n=v.MAX_N_PD
            )
        assert e.value.param == "n", value
    v.check_request(endpoint, {**base, "n": 1.0}, vocab_size=VOCAB, text_only=True, verify=VERIFY, max_n=v.MAX_N_PD)


@pytest.mark.parametrize("name", ["max_tokens", "seed", "top_k", "min_tokens"])
def test_a_boolean_is_not_a_count(name):
    assert rejected(v.COMPLETIONS, {"prompt": "hi", name: True}).param == name


def test_generate_takes_integers_as_integers():
    for value in (2.0, True, 1e300):
        assert rejected(v.GENERATE, {"text": "hi", "sampling_params": {"n": value}}).param == "sampling_params.n"
        assert rejected(v.GENERATE, {"text": "hi", "top_logprobs_num": value}).param == "top_logprobs_num"


@pytest.mark.parametrize("endpoint,base", [(v.COMPLETIONS, {"prompt": "hi"}), (v.CHAT, {"messages": MSG})])
def test_openai_requests_name_the_model(endpoint, base):
    """The router refuses a request without `model` (422, text/plain) that SGLang's schema accepts:
    every layer refuses it the same way instead."""
    for body in (base, {**base, "model": ""}, {**base, "model": 7}):
        with pytest.raises(ClientError) as e:
            v.check_request(endpoint, body, vocab_size=VOCAB, text_only=True, verify=VERIFY)
        assert e.value.param == "model"

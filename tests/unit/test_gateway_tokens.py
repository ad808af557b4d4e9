"""The gateway's prompt count: the bytes bound that spares encoding short prompts holds wherever
it is used and is refused where it would not hold; long prompts are encoded off the event loop;
the bound never lets an over-length prompt through."""

import asyncio
import json
import time

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, normalizers

from glm53_serving.admission import Limits
from glm53_serving.errors import ClientError
from glm53_serving.gateway.app import ENCODE_ON_LOOP_MAX_CHARS, Gateway, GatewayConfig
from glm53_serving.gateway.tokens import tokens_at_most_bytes
from glm53_serving.models import tiny

LIMITS = Limits(506, 510, 512)  # prompts of at most 505 tokens


class JsonRequest:
    headers = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def gw():
    return Gateway(
        GatewayConfig(
            upstream="http://127.0.0.1:9",
            model_path=str(tiny.ensure()),
            served_model_name="glm53-tiny",
            context_length=512,
            limits=LIMITS,
            max_body_bytes=8 * 1024 * 1024,
            upstream_timeout_s=600.0,
        )
    )


@pytest.fixture(scope="module")
def specials(gw):
    return [t.content for t in gw.counter.tokenizer.backend_tokenizer.get_added_tokens_decoder().values()]


def test_the_tiny_tokenizer_is_bounded_by_its_bytes(gw):
    assert gw.counter.bounded_by_bytes


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_no_text_has_more_tokens_than_utf8_bytes(gw, specials, data):
    pieces = st.one_of(
        st.text(max_size=40), st.sampled_from(specials), st.sampled_from([" ", "\n", "  \t", "\u00e9", "\U0001f600"])
    )
    text = "".join(data.draw(st.lists(pieces, max_size=12)))
    assert gw.counter.encode(text) <= gw.counter.at_most(text)


def _spec(**parts):
    base = {
        "normalizer": None,
        "model": {"type": "BPE"},
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
    }
    return json.dumps({**base, **parts})


@pytest.mark.parametrize(
    "spec, bounded",
    [
        (_spec(), True),
        (
            _spec(
                pre_tokenizer={
                    "type": "Sequence",
                    "pretokenizers": [
                        {"type": "Split", "pattern": {"Regex": "\\s+"}},
                        {"type": "ByteLevel", "add_prefix_space": False},
                    ],
                }
            ),
            True,
        ),
        (_spec(normalizer={"type": "NFKC"}), False),  # expands: U+FDFA, 3 bytes, is 18 letters
        (_spec(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True}), False),  # adds a byte
        (_spec(pre_tokenizer={"type": "Metaspace", "replacement": "\u2581"}), False),  # adds a "\u2581"
        (_spec(model={"type": "Unigram"}), False),
        (
            _spec(pre_tokenizer={"type": "Sequence", "pretokenizers": [{"type": "Metaspace"}, {"type": "ByteLevel"}]}),
            False,
        ),
        (_spec(pre_tokenizer=None), False),  # no byte-level start: unknown characters
    ],
)
def test_the_bound_is_only_claimed_for_tokenizers_that_keep_it(spec, bounded):
    assert tokens_at_most_bytes(spec) is bounded


def test_an_expanding_normalizer_breaks_the_bound_which_is_why_it_is_refused():
    tok = Tokenizer.from_file(str(tiny.ensure() / "tokenizer.json"))
    tok.normalizer = normalizers.NFKC()
    assert len(tok.encode("\ufdfa", add_special_tokens=False).ids) > len("\ufdfa".encode())
    assert not tokens_at_most_bytes(tok.to_str())


def _completion(prompt: str) -> bytes:
    return orjson.dumps({"model": "glm53-tiny", "prompt": prompt, "max_tokens": 4})


def test_a_prompt_over_the_limit_in_bytes_but_not_in_tokens_is_admitted(gw):
    text = "hello world " * 200  # 2,400 bytes, far fewer tokens
    assert len(text.encode()) > 505 and gw.counter.encode(text) + 4 <= 510
    asyncio.run(gw.judge_generation(JsonRequest, "/v1/completions", _completion(text), "acme"))


@pytest.mark.parametrize("size", [300, 3000, 40_000])  # on the loop, and off it
def test_a_prompt_over_the_limit_in_tokens_is_refused_with_its_count(gw, size):
    text = "".join(chr(0x4E00 + i % 2000) for i in range(size))  # ~3 bytes a character
    n = gw.counter.encode(text)
    assert n >= 506
    with pytest.raises(ClientError) as e:
        asyncio.run(gw.judge_generation(JsonRequest, "/v1/completions", _completion(text), "acme"))
    assert e.value.code == "context_length_exceeded" and e.value.details["prompt_tokens"] == n


def test_a_long_prompt_is_encoded_without_stalling_the_event_loop(gw):
    text = "def f(x):\n    return x + 1\n" * 30_000  # 810 KB: hundreds of ms to encode
    assert len(text) > ENCODE_ON_LOOP_MAX_CHARS
    t0 = time.perf_counter()
    gw.counter.encode(text)
    encode_s = time.perf_counter() - t0

    async def main():
        gaps, judged = (
            [],
            asyncio.create_task(gw.judge_generation(JsonRequest, "/v1/completions", _completion(text), "acme")),
        )
        last = time.perf_counter()
        while not judged.done():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        with pytest.raises(ClientError):
            judged.result()
        return max(gaps)

    longest_gap = asyncio.run(main())
    assert encode_s > 0.2 and longest_gap < encode_s / 4, (encode_s, longest_gap)

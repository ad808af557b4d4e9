"""Prompt token counting with the model's own tokenizer and chat template.

SGLang renders a chat with the tokenizer's chat template (add_generation_prompt=True) and then
encodes the text without adding special tokens again; /v1/completions and /generate encode the
text as is. tests/e2e/test_gateway.py proves the counts equal the server's `prompt_tokens` on
random chats.

Encoding is the gateway's one cost that grows with the prompt (~2 µs a token here: a 256 KB
agent prompt is 240 ms), so the gateway encodes only what a bound cannot decide: with a
byte-level BPE and no normalizer a prompt has at most as many tokens as UTF-8 bytes
(`at_most`), and a prompt whose bytes fit the limit needs no count at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class Uncountable(ValueError):
    """The request's prompt is not in a form this counter understands (let the server judge it)."""


# Pre-tokenizers that only split or drop text beside ByteLevel; any other (Metaspace's prefix "▁",
# a normalizer's NFKC expansion) may make more tokens than bytes.
_SPLIT_ONLY = {"Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit"}


def tokens_at_most_bytes(backend_json: str) -> bool:
    """Whether this tokenizer (its `tokenizer.json`) never makes more tokens than UTF-8 bytes:
    ByteLevel pre-tokenization starts every piece from one symbol per byte, BPE merges only
    join symbols, added tokens match one or more bytes each, and nothing adds characters."""
    spec = json.loads(backend_json)
    if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
        return False
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    return (
        bool(byte_level)
        and not any(s.get("add_prefix_space") for s in byte_level)
        and all(s.get("type") in _SPLIT_ONLY | {"ByteLevel"} for s in steps)
    )


@dataclass(slots=True)
class PromptCounter:
    model_path: str
    _tok: Any = None
    bounded_by_bytes: bool = field(
        init=False, default=False
    )  # tokens <= UTF-8 bytes holds for this tokenizer (checked, not assumed)

    def __post_init__(self):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(self.model_path)
        backend = getattr(self._tok, "backend_tokenizer", None)
        self.bounded_by_bytes = backend is not None and tokens_at_most_bytes(backend.to_str())

    @property
    def tokenizer(self):
        return self._tok

    def encode(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False))

    def at_most(self, text: str) -> int | None:
        """An upper bound on `encode(text)` without encoding, or None where this tokenizer has none."""
        return len(text.encode()) if self.bounded_by_bytes else None

    def render_chat(self, messages: list[dict]) -> str:
        norm = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):  # text parts only: a text-only model
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise Uncountable("non-text content parts")
                content = "".join(p.get("text", "") for p in content)
            if not isinstance(m.get("role"), str) or not isinstance(content, (str, type(None))):
                raise Uncountable("malformed message")
            norm.append({"role": m["role"], "content": content or ""})
        return self._tok.apply_chat_template(norm, tokenize=False, add_generation_prompt=True)

    def prompt_of(self, endpoint: str, body: dict) -> tuple[str | int, int | None]:
        """(the text to encode, or the prompt's token count where it came as ids; requested output
        tokens or None) for a generation request body."""
        if endpoint == "/v1/chat/completions":
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                raise Uncountable("messages")
            max_new = body.get("max_completion_tokens", body.get("max_tokens"))
            return self.render_chat(msgs), _int_or_none(max_new)
        if endpoint == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                prompt = len(prompt)
            elif not isinstance(prompt, str):
                raise Uncountable("prompt")
            return prompt, _int_or_none(body.get("max_tokens"))
        if endpoint == "/generate":
            params = body.get("sampling_params") or {}
            if not isinstance(params, dict):
                raise Uncountable("sampling_params")
            if isinstance(body.get("input_ids"), list) and all(isinstance(t, int) for t in body["input_ids"]):
                prompt = len(body["input_ids"])
            elif isinstance(body.get("text"), str):
                prompt = body["text"]
            else:
                raise Uncountable("batch or non-text input")
            return prompt, _int_or_none(params.get("max_new_tokens"))
        raise Uncountable(endpoint)


def _int_or_none(v) -> int | None:
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise Uncountable("max tokens")

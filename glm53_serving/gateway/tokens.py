"""Prompt token counting with the model's own tokenizer and chat template.

SGLang renders a chat with the tokenizer's chat template (add_generation_prompt=True) and then
encodes the text without adding special tokens again; /v1/completions and /generate encode the
text as is. tests/e2e/test_gateway.py proves the counts equal the server's `prompt_tokens` on
random chats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class Uncountable(ValueError):
    """The request's prompt is not in a form this counter understands (let the server judge it)."""


@dataclass(slots=True)
class PromptCounter:
    model_path: str
    _tok: Any = None

    def __post_init__(self):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(self.model_path)

    @property
    def tokenizer(self):
        return self._tok

    def encode(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False))

    def chat(self, messages: list[dict]) -> int:
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
        text = self._tok.apply_chat_template(norm, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def count(self, endpoint: str, body: dict) -> tuple[int, int | None]:
        """(prompt tokens, requested output tokens or None) for a generation request body."""
        if endpoint == "/v1/chat/completions":
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                raise Uncountable("messages")
            max_new = body.get("max_completion_tokens", body.get("max_tokens"))
            return self.chat(msgs), _int_or_none(max_new)
        if endpoint == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                n = self.encode(prompt)
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                n = len(prompt)
            else:
                raise Uncountable("prompt")
            return n, _int_or_none(body.get("max_tokens"))
        if endpoint == "/generate":
            params = body.get("sampling_params") or {}
            if not isinstance(params, dict):
                raise Uncountable("sampling_params")
            if isinstance(body.get("input_ids"), list) and all(isinstance(t, int) for t in body["input_ids"]):
                n = len(body["input_ids"])
            elif isinstance(body.get("text"), str):
                n = self.encode(body["text"])
            else:
                raise Uncountable("batch or non-text input")
            return n, _int_or_none(params.get("max_new_tokens"))
        raise Uncountable(endpoint)


def _int_or_none(v) -> int | None:
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise Uncountable("max tokens")

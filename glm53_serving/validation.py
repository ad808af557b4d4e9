"""Request validation: what a generation request must be before any handler or scheduler sees it.

Invariant: a request body on /generate, /v1/completions or /v1/chat/completions that is not
valid UTF-8 JSON of the endpoint's schema, has a sampling parameter outside its domain, or asks
a text-only model for another modality, is a 400 in the contract shape (errors.py) whose `param`
names the field as the client spelled it (OpenAI names on OpenAI endpoints,
`sampling_params.<name>` on /generate).

Attacks closed (measured on upstream 0.5.23, CPU, glm53-tiny; docs/validation.md):
- `logprobs` / `top_logprobs` / `top_logprobs_num` above the vocabulary size kills the server
  (`topk` out of range in the scheduler's sampler);
- a batch /generate whose `sampling_params` list is shorter than the batch is a 500;
- `n: 0` is a 400 "range() arg 3 must not be zero", `n: 1000` runs 1000 generations;
- media fields on a text-only /generate, negative `logprobs`, out-of-vocabulary
  `stop_token_ids` are silently ignored (200);
- every other rejection upstream already makes comes in four different shapes, mostly without
  `param`, some echoing the input and server file paths.

The judgments are SGLang's own wherever SGLang has one: its pydantic request models, the
/generate JSON contract (`api_contract.generate_contract_error`) and `SamplingParams.verify`;
this module only finds which field failed and adds the few bounds SGLang lacks.
Pure functions; `request_guard.py` runs them in each server's HTTP process, the gateway runs
`parse_body` at the client endpoint.
"""

from __future__ import annotations

import collections
import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from glm53_serving.errors import ClientError

GENERATE, COMPLETIONS, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
GENERATION = (GENERATE, COMPLETIONS, CHAT)

MAX_N = 128  # OpenAI's bound on `n`; each sample is a full generation
# PD: SGLang sends every sample of a request under one bootstrap room; all but one never
# bootstrap, the client waits for the router's timeout and prefill keeps the rest queued (measured).
MAX_N_PD = 1
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs; completions' `logprobs` gets the same
# OpenAI's bounds where they are narrower than SGLang's: sglang-router (PD) enforces them on the
# OpenAI endpoints, so every server applies them too and all layers give the same answer.
OPENAI_MAX_TEMPERATURE = 2.0
OPENAI_MAX_STOP = 4

# OpenAI request field -> SamplingParams field (what the serving layer converts it to).
OPENAI_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "logit_bias": "logit_bias",
}
# Media a text-only model cannot take: /generate fields, and chat content part types.
MEDIA_FIELDS = ("image_data", "video_data", "audio_data", "input_embeds")
MEDIA_PARTS = {
    "image_url",
    "image",
    "input_image",
    "video_url",
    "video",
    "audio_url",
    "input_audio",
    "audio",
    "file",
    "input_file",
}
_JSON_TYPES = ("application/json",)
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")  # request field names; pydantic's union tags are not


def invalid(message: str, param: str | None = None) -> ClientError:
    return ClientError("invalid_request_error", message, param=param)


# --- body ---------------------------------------------------------------------------------------


def parse_body(raw: bytes, content_type: str | None) -> dict:
    """The JSON object in a request body: UTF-8 (no BOM, no lone surrogates), no NaN/Infinity,
    nesting within orjson's 1024 levels; else a 400 naming what is wrong."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media and media not in _JSON_TYPES:
        raise invalid(f"Content-Type must be application/json, not {media!r}.")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"The request body is not valid UTF-8 (byte {e.start}).") from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise invalid(f"The request body is not valid JSON: {e}.") from None
    if not isinstance(body, dict):
        raise invalid(f"The request body must be a JSON object, not {type(body).__name__}.")
    return body


# --- schema -------------------------------------------------------------------------------------


def param_of(loc: Iterable[Any]) -> str | None:
    """A pydantic error location as an OpenAI-style param (`messages[0].content`), without
    pydantic's union-branch tags (`str`, `list[str]`, model class names)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (
            part != "body" and _FIELD.match(part) and part not in ("str", "int", "float", "bool", "list", "dict", "any")
        ):
            out += f".{part}" if out else part
    return out or None


def _first_pydantic_error(err) -> ClientError:
    # Each member of a union reports its own error: the field most of them fail on is the one
    # the client got wrong (a bad content part's `type`, not a field only one member has).
    errors = err.errors(include_url=False, include_input=False)
    params = [param_of(e["loc"]) for e in errors]
    counts = collections.Counter(params)
    best_i = max(range(len(errors)), key=lambda i: (counts[params[i]], len(errors[i]["loc"]), -i))
    best, param = errors[best_i], params[best_i]
    return invalid(f"{best['msg']} ({param})" if param else best["msg"], param)


SAMPLE = 64  # list elements validated first (see check_schema)
# JSON objects and arrays in one request: bounds what a failing full validation can cost (each
# failing object costs one error per union member); far above any servable request's count
# (a token-id list is one array, a chat message two or three objects).
MAX_CONTAINERS = 4096
# Entries of one array or object, lists of ints aside: a prompt's token ids are judged by the
# deployment's length limit (admission's contract, context_length_exceeded), and an int list can
# fail only by type, which the sample below catches. Every other list (a batch of prompts, stop
# strings, content parts) and every object (logit_bias) is held to MAX_ITEMS. Without it the
# sample is dodged by values whose validity depends on the value, not the type: stop_token_ids of
# 64 "1"s and then 1.6 million "a"s (6.4 MB) passed it and cost 11 s of pydantic's error
# reporting, and a 1.6-million-prompt completions batch was valid (measured).
MAX_ITEMS = 4096
# Nesting: no request of any endpoint nests deeper than about ten levels; orjson allows 1024, and
# Python code walking such a body recursively (ours, upstream's) meets the recursion limit first
# (measured: a 1000-deep body reset the connection).
MAX_DEPTH = 64


def check_schema(endpoint: str, body: dict) -> None:
    """SGLang's own request schema for the endpoint, as FastAPI would apply it.

    Cost bound: pydantic reports every failing element of every union member, so a list of 200 000
    wrong elements costs tens of seconds of the event loop (measured: 31 s for 200 000 chat content parts, 3.8 s for 16 000),
    the server's whole HTTP process stalling for every tenant. So first, in one pass that stops at
    the first breach, every array and object must stay within its length bound, every list hold
    one kind of element, and the body stay within MAX_CONTAINERS and MAX_DEPTH; then the body is
    validated with each list cut to its first SAMPLE elements, and only then whole: a body that
    reaches the full validation has at most MAX_ITEMS failing elements per list (lists of ints
    fail by type, which the sample catches)."""
    from pydantic import ValidationError

    _check_uniform(body)
    try:
        _model(endpoint).validate_python(_sampled(body))
        _model(endpoint).validate_python(body)
    except ValidationError as e:
        raise _first_pydantic_error(e) from None
    if endpoint == GENERATE:
        _check_generate_contract(body)


def _sampled(value):
    if isinstance(value, dict):
        return {k: _sampled(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_sampled(v) for v in value[:SAMPLE]]
    return value


def _check_uniform(body: dict) -> None:
    """The bounds above, and every chat message and content part an object with a string role /
    type: one pass, no union errors, no work past a container's bound. Containers are counted as
    they are found, so a list of a million objects is refused before any of them is visited."""
    stack: list[tuple[str, dict | list, int]] = [("", body, 1)]
    containers = 1
    while stack:
        path, value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise invalid(f"The request nests JSON deeper than {MAX_DEPTH} levels.", path)
        if isinstance(value, dict):
            if len(value) > MAX_ITEMS:
                raise invalid(
                    f"{path or 'The request body'} has {len(value)} entries; at most {MAX_ITEMS}.", path or None
                )
            children = [(f"{path}.{k}" if path else str(k), v) for k, v in value.items() if isinstance(v, (dict, list))]
        else:
            children = _check_list(path, value)
        containers += len(children)
        if containers > MAX_CONTAINERS:
            raise invalid(f"The request has more than {MAX_CONTAINERS} JSON objects and arrays.")
        stack.extend((p, v, depth + 1) for p, v in children)


def _check_list(path: str, value: list) -> list[tuple[str, dict | list]]:
    """One list's bounds and kind; its containers, to visit."""
    kinds = {type(v) for v in value if v is not None}
    if len(value) > MAX_ITEMS and kinds != {int}:
        raise invalid(
            f"{path} has {len(value)} elements; a list has at most {MAX_ITEMS} (lists of token ids aside).", path
        )
    if len(kinds) > 1 and not _FREE_FORM.search(path):
        first = type(next(v for v in value if v is not None))
        i = next(i for i, v in enumerate(value) if v is not None and type(v) is not first)
        raise invalid(
            f"{path}[{i}] is a {type(value[i]).__name__}, unlike {path}[0]: a list holds one kind of element.",
            f"{path}[{i}]",
        )
    if dict in kinds and (path == "messages" or path.endswith(".content")):
        key = "role" if path == "messages" else "type"
        for i, v in enumerate(value):
            if isinstance(v, dict) and not isinstance(v.get(key), str):
                raise invalid(f"{path}[{i}].{key} is required and must be a string.", f"{path}[{i}].{key}")
            if key == "role" and not isinstance(v.get("content"), (str, list, type(None))):
                raise invalid(f"{path}[{i}].content must be a string, a list of parts or null.", f"{path}[{i}].content")
    if not kinds & {dict, list}:
        return []
    return [(f"{path}[{i}]", v) for i, v in enumerate(value) if isinstance(v, (dict, list))]


# Fields that hold arbitrary JSON (a tool's JSON Schema, a response schema, custom params): their
# lists may mix kinds (`"enum": [1, "a"]`), so only the size and depth bounds apply there.
# Elsewhere int and float count as two kinds: [1, 1.5, 1.5, ...] as token ids costs one pydantic
# error per float (measured: 3.6 s for 200 000).
_FREE_FORM = re.compile(r"\.parameters\b|json_schema|custom_params|\.schema\b")


@functools.cache
def _model(endpoint: str):
    from pydantic import TypeAdapter

    if endpoint == GENERATE:
        from sglang.srt.managers.io_struct import GenerateReqInput as model
    elif endpoint == COMPLETIONS:
        from sglang.srt.entrypoints.openai.protocol import CompletionRequest as model
    else:
        from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest as model
    return TypeAdapter(model)


def _check_generate_contract(body: dict) -> None:
    """/generate's JSON contract names no field in its errors: find the one that fails alone."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    message = generate_contract_error(body)
    if message is None:
        return
    param = None
    for key, value in body.items():
        if generate_contract_error({key: value}) is None:
            continue
        param = key
        if isinstance(value, dict):
            param = next((f"{key}.{k}" for k, v in value.items() if generate_contract_error({key: {k: v}})), key)
        break
    raise invalid(f"{message} ({param})" if param else message, param)


# --- semantics SGLang does not check --------------------------------------------------------------


def check_bounds(endpoint: str, body: dict, *, text_only: bool, max_n: int = MAX_N) -> None:
    if endpoint == GENERATE:
        _check_generate_bounds(body, text_only, max_n)
        return
    if not isinstance(body.get("model"), str) or not body["model"]:
        # OpenAI's API requires it, and sglang-router refuses a request without it (a text/plain
        # 422 the gateway could only pass on), while SGLang's own schema defaults it.
        raise invalid("model is required: the served model's name (GET /v1/models).", "model")
    for name in _integer_fields(endpoint):
        _integer(body, name)
    _range(body, "n", 1, max_n)
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and temperature > OPENAI_MAX_TEMPERATURE:
        raise invalid(f"temperature must be at most {OPENAI_MAX_TEMPERATURE:g}, got {temperature}.", "temperature")
    if isinstance(body.get("stop"), list) and len(body["stop"]) > OPENAI_MAX_STOP:
        raise invalid(f"stop takes at most {OPENAI_MAX_STOP} sequences, got {len(body['stop'])}.", "stop")
    if endpoint == COMPLETIONS:
        _range(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        n = _integer(body, "n") or 1
        _range(body, "best_of", n, max_n, why=f"at least n ({n})" if n > 1 else None)
    else:
        _range(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if (_integer(body, "top_logprobs") or 0) > 0 and not body.get("logprobs"):
            raise invalid("top_logprobs requires logprobs to be true.", "top_logprobs")
        if text_only:
            _check_chat_media(body["messages"])


def check_prompt(endpoint: str, body: dict, vocab_size: int) -> None:
    """A prompt is present, not empty, and its token ids (where given as ids) are in the vocabulary;
    named as the endpoint names it (intake checks the ids again after tokenization)."""
    if endpoint == CHAT:
        if not body["messages"]:
            raise invalid("messages must contain at least one message.", "messages")
        return
    name = "prompt" if endpoint == COMPLETIONS else ("input_ids" if body.get("input_ids") is not None else "text")
    prompt = body.get(name)
    if endpoint == GENERATE and prompt is None and body.get("input_embeds") is None:
        raise invalid("Give the prompt as text or input_ids.", "text")
    if prompt is not None and len(prompt) == 0:
        raise invalid(f"{name} is empty.", name)
    rows = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
    for row in rows:
        if isinstance(row, list) and row and isinstance(row[0], int):
            check_token_ids(row, vocab_size, name)


def _check_generate_bounds(body: dict, text_only: bool, max_n: int) -> None:
    if text_only:
        for name in MEDIA_FIELDS:
            if body.get(name) is not None:
                raise invalid(f"This model takes text only; {name} is not accepted.", name)
    if body.get("text") is not None and body.get("input_ids") is not None:
        raise invalid("Give either text or input_ids, not both.", "input_ids")
    _range(body, "top_logprobs_num", 0, MAX_TOP_LOGPROBS)
    params = body.get("sampling_params")
    if isinstance(params, list):
        size = _batch_size(body)
        if size is not None and len(params) != size:
            raise invalid(f"sampling_params has {len(params)} entries for a batch of {size}.", "sampling_params")
        for i, p in enumerate(params):
            _range(p, "n", 1, max_n, prefix=f"sampling_params[{i}].")
    elif isinstance(params, dict):
        _range(params, "n", 1, max_n, prefix="sampling_params.")


def _batch_size(body: dict) -> int | None:
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return 1 if text is not None or ids is not None else None


def _check_chat_media(messages: list) -> None:
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                raise invalid(
                    f"This model takes text only; content type {kind!r} is not accepted.",
                    f"messages[{i}].content[{j}].type",
                )


def _range(obj: dict, name: str, lo: int, hi: int, *, prefix: str = "", why: str | None = None) -> None:
    """`obj[name]` within [lo, hi] by its value: pydantic turns an integral float (2.0, 1000.0)
    into an int for SGLang, so it is judged as that int here too (a bound skipped for floats let
    `n: 1000.0` run 1,000 generations and `n: 2.0` reach a PD worker)."""
    value = _integer(obj, name, prefix)
    if value is not None and not lo <= value <= hi:
        raise invalid(
            f"{prefix}{name} must be in [{lo}, {hi}]{f' ({why})' if why else ''}, got {obj[name]}.", prefix + name
        )


def _integer(obj: dict, name: str, prefix: str = "") -> int | None:
    """The integer a field holds as SGLang will read it; None when absent or not a number (a type
    error the schema reports). A boolean is not a count: refused."""
    value = obj.get(name)
    if isinstance(value, bool):
        raise invalid(f"{prefix}{name} must be an integer, not a boolean.", prefix + name)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else None


@functools.cache
def _integer_fields(endpoint: str) -> tuple[str, ...]:
    """The top-level integer fields of an OpenAI endpoint's request model."""
    import typing

    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    model = CompletionRequest if endpoint == COMPLETIONS else ChatCompletionRequest
    out = []
    for name, f in model.model_fields.items():
        args = typing.get_args(f.annotation) or (f.annotation,)
        if int in args and bool not in args:
            out.append(name)
    return tuple(out)


# --- sampling parameter domains: SGLang's SamplingParams.verify, attributed ---------------------


def sampling_fields(endpoint: str, body: dict) -> list[tuple[str, dict]]:
    """(param prefix or OpenAI field map, SGLang sampling kwargs) for each request in the body."""
    if endpoint == GENERATE:
        params = body.get("sampling_params")
        if isinstance(params, list):
            return [(f"sampling_params[{i}].", p) for i, p in enumerate(params) if isinstance(p, dict)]
        return [("sampling_params.", params)] if isinstance(params, dict) else []
    return [("", {OPENAI_SAMPLING[k]: v for k, v in body.items() if k in OPENAI_SAMPLING and v is not None})]


def check_sampling(endpoint: str, body: dict, vocab_size: int, verify: Callable[[dict, int], None]) -> None:
    """Each request's sampling parameters through `verify` (SGLang's SamplingParams
    construction, normalize and verify); a failure names the field that fails on its own."""
    for prefix, params in sampling_fields(endpoint, body):
        try:
            verify(params, vocab_size)
            _check_stop_token_ids(params.get("stop_token_ids"), vocab_size)
        except (ValueError, TypeError) as e:
            raise invalid(str(e), _culprit(endpoint, body, prefix, params, vocab_size, verify, str(e))) from None


def _check_stop_token_ids(ids, vocab_size: int) -> None:
    # Upstream ignores ids outside the vocabulary (they can never match): say so instead.
    if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        check_token_ids(ids, vocab_size, "stop_token_ids")


def _culprit(endpoint, body, prefix, params, vocab_size, verify, message) -> str | None:
    def fails(k):
        try:
            verify({k: params[k]}, vocab_size)
            _check_stop_token_ids(params.get("stop_token_ids") if k == "stop_token_ids" else None, vocab_size)
            return False
        except (ValueError, TypeError):
            return True

    alone = [k for k in params if fails(k)]
    # A pair fails only together (min_new_tokens > max_new_tokens): the first one the message names.
    named = alone or sorted((k for k in params if k in message), key=message.find)
    if not named:
        return None
    sglang_name = named[0]
    if endpoint == GENERATE:
        return prefix + sglang_name
    return next((k for k, v in OPENAI_SAMPLING.items() if v == sglang_name and k in body), sglang_name)


def sglang_verify(tokenizer, cls=None) -> Callable[[dict, int], None]:
    """What the tokenizer manager does to a request's sampling parameters (its
    `sampling_params_class`, normalized with its tokenizer, verified)."""

    def verify(params: dict, vocab_size: int) -> None:
        nonlocal cls
        if cls is None:
            from sglang.srt.sampling.sampling_params import SamplingParams as cls
        sp = cls(**params)
        sp.normalize(tokenizer)
        sp.verify(vocab_size)

    return verify


def check_request(
    endpoint: str,
    body: dict,
    *,
    vocab_size: int,
    text_only: bool,
    verify: Callable[[dict, int], None],
    max_n: int = MAX_N,
) -> None:
    """Every check above, in the order a client would fix them: shape, bounds, domains."""
    check_schema(endpoint, body)
    check_bounds(endpoint, body, text_only=text_only, max_n=max_n)
    check_prompt(endpoint, body, vocab_size)
    check_sampling(endpoint, body, vocab_size, verify)


@dataclass(frozen=True, slots=True)
class RequestChecks:
    """`check_request` bound to one model: what a server's HTTP process and the gateway run."""

    vocab_size: int
    text_only: bool
    verify: Callable[[dict, int], None]
    max_n: int = MAX_N

    @classmethod
    def for_model(cls, model_path: str, tokenizer, max_n: int = MAX_N) -> RequestChecks:
        """From a checkpoint directory, as SGLang's ModelConfig judges it; loads SGLang's request
        models now so that no client request pays for the import."""
        from sglang.srt.configs.model_config import is_multimodal_model
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
        return cls(
            config.vocab_size, not is_multimodal_model(config.architectures or []), sglang_verify(tokenizer), max_n
        ).warmed()

    def warmed(self) -> RequestChecks:
        """Build SGLang's request models and run one request per endpoint now: done lazily, the
        first requests after start took 2 to 7 s on a busy 2-core machine (measured)."""
        for endpoint, body in (
            (GENERATE, {"text": "x", "sampling_params": {"max_new_tokens": 1, "stop": ["y"]}}),
            (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 1}),
            (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
        ):
            self.check(endpoint, body)
        return self

    def check(self, endpoint: str, body: dict) -> None:
        check_request(
            endpoint, body, vocab_size=self.vocab_size, text_only=self.text_only, verify=self.verify, max_n=self.max_n
        )


# --- after tokenization (intake's hook) ---------------------------------------------------------


def check_token_ids(ids, vocab_size: int, param: str) -> None:
    """Every id of a prompt (or of stop_token_ids) inside the vocabulary: an id outside it kills the
    scheduler upstream (IndexError in the embedding lookup). One min and max, no Python loop."""
    if not ids:
        return
    try:
        lo, hi = min(ids), max(ids)
    except TypeError:
        return  # not a list of numbers: a type error the schema reports
    if lo < 0 or hi >= vocab_size:
        raise ClientError(
            "invalid_request_error",
            f"{param} contains token id {lo if lo < 0 else hi}, outside this model's vocabulary [0, {vocab_size}).",
            param=param,
            details={"vocab_size": vocab_size},
        )


def prompt_param(endpoint: str | None, token_ids: bool) -> str:
    """The field a client sent its prompt in, as its endpoint names it."""
    return {COMPLETIONS: "prompt", CHAT: "messages"}.get(endpoint or "", "input_ids" if token_ids else "text")


def check_tokenized(input_ids, top_logprobs_num, vocab_size: int, endpoint: str | None, param: str) -> None:
    """Right before the scheduler, whatever path the request took: an empty prompt (a zero-token
    MoE forward) and more top logprobs than the vocabulary both kill the scheduler upstream."""
    if input_ids is not None and len(input_ids) == 0:
        raise invalid("The prompt is empty: it has no tokens.", param)
    if isinstance(top_logprobs_num, int) and not 0 <= top_logprobs_num <= min(MAX_TOP_LOGPROBS, vocab_size):
        param = {COMPLETIONS: "logprobs", CHAT: "top_logprobs"}.get(endpoint or "", "top_logprobs_num")
        raise invalid(f"{param} must be in [0, {min(MAX_TOP_LOGPROBS, vocab_size)}], got {top_logprobs_num}.", param)

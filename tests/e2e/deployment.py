"""The deployment the e2e tests run: the launcher's default topology file (GLM53_TOPOLOGY picks
another, e.g. `GLM53_TOPOLOGY=launch/cpu-gqa.toml scripts/test tests/e2e`), and what the tests
derive from it instead of hard-coding one model's numbers."""

from __future__ import annotations

import re
from pathlib import Path

from glm53_serving.admission import Limits
from glm53_serving.topology import Topology, default_config_path

CONFIG: Path = default_config_path()
TOPOLOGY = Topology.load(CONFIG)
MODEL = TOPOLOGY.model.served_model_name
CONTEXT = TOPOLOGY.model.context_length
PAGE = TOPOLOGY.role_value("single", "page_size") or 1
KV_TOKENS = TOPOLOGY.worker.kv_tokens


def limits(topology: str = "pd") -> Limits:
    _, lim = Topology.load(CONFIG, topology).admission_plan()
    return lim


# max_input_tokens (exclusive) and max_total_tokens, the same in both topologies of the file
# (docs/admission.md): the tests that need them for one topology only would otherwise drift.
P, T = limits().max_input_tokens, limits().max_total_tokens
if (P, T) != (limits("single").max_input_tokens, limits("single").max_total_tokens):
    raise RuntimeError(f"{CONFIG}: single and PD limits differ; the e2e tests assume one pair")


# A generation long enough to keep running while a test acts on it: 400 tokens where the
# budget allows (after a prompt of up to 64 tokens).
LONG = min(400, T - 64)


def config_text() -> str:
    return CONFIG.read_text()


def set_keys(text: str, section: str, **values) -> str:
    """`text` with `values` set in its [section] (replacing a key the section has, adding the
    others under its header); values are TOML literals (`kv_tokens=256`, `mode='"off"'`)."""
    m = re.search(rf"^\[{section}\][^\n]*\n", text, flags=re.M)
    if m is None:
        raise ValueError(f"{CONFIG}: no [{section}] section")
    end = re.search(r"^\[", text[m.end() :], flags=re.M)
    body = text[m.end() : m.end() + end.start()] if end else text[m.end() :]
    added = ""
    for key, value in values.items():
        body, n = re.subn(rf"^{key}\s*=.*$", f"{key} = {value}", body, count=1, flags=re.M)
        if n == 0:
            added += f"{key} = {value}\n"
    return text[: m.end()] + added + body + (text[m.end() + end.start() :] if end else "")


def model_path() -> str:
    """The checkpoint of the file's preset, generated if missing."""
    from glm53_serving.launch import resolve_model_path

    return resolve_model_path(TOPOLOGY)


def reference_model():
    """HF transformers on the same weights: greedy output the servers must equal (for the DSA
    model with the fp8 index keys SGLang stores, tests/hf_reference.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from glm53_serving.topology import DSA_PRESETS
    from tests import hf_reference

    if TOPOLOGY.model.preset in DSA_PRESETS:
        return hf_reference.load(model_path())
    return AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32).eval()


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    from tests import hf_reference

    return hf_reference.greedy(model, ids, n)

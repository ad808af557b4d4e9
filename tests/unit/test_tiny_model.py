"""glm53-tiny is generated deterministically, in HF layout, with GLM-5.3's MoE block family."""

import hashlib
import json

from glm53_serving.models import tiny


def digest(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_generation_is_deterministic(tmp_path):
    a, b = tiny.ensure(tmp_path / "a"), tiny.ensure(tmp_path / "b")
    assert digest(a) == digest(b)


def test_layout_and_moe_family(tmp_path):
    d = tiny.ensure(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"]
    assert (
        cfg["first_k_dense_replace"] == 1
        and cfg["n_shared_experts"] == 1
        and cfg["n_routed_experts"] > cfg["num_experts_per_tok"]
    )
    from safetensors import safe_open

    with safe_open(d / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.gate_proj.weight" in keys  # first layer dense
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys  # sigmoid routing with correction bias
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in keys


def test_chat_template_is_glm_style(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.ensure(tmp_path / "m"))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "[gMASK]<sop><|user|>\nhi<|assistant|>\n"
    assert tok.eos_token_id == 0


def test_ensure_reuses_an_existing_checkpoint(tmp_path):
    d = tiny.ensure(tmp_path / "m")
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure(d) == d and (d / "model.safetensors").stat().st_mtime_ns == mtime

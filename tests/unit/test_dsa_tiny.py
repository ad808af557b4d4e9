"""glm53-tiny (the default): a deterministic tiny GlmMoeDsaForCausalLM with the settings SGLang's
CPU path needs, and a deployment file that serves it with 64-token pages."""

import hashlib
import json

import pytest

from glm53_serving.models import dsa_tiny, tiny
from glm53_serving.topology import PRESETS, REPO_LAUNCH_DIR, Topology


def digest(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return dsa_tiny.ensure(tmp_path_factory.mktemp("dsa") / "m")


def test_generation_is_deterministic(ckpt, tmp_path):
    assert digest(dsa_tiny.ensure(tmp_path / "b")) == digest(ckpt)


def test_config_is_glm5_dsa_with_what_sglang_needs(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["GlmMoeDsaForCausalLM"] and cfg["model_type"] == "glm_moe_dsa"
    # selection is really used on prompts longer than index_topk; SGLang's pool asserts head dim 128
    assert cfg["index_topk"] == 16 and cfg["index_head_dim"] == 128
    # SGLang: interleaved indexer RoPE as HF, and what DeepseekV2 construction reads
    assert cfg["indexer_rope_interleave"] is True and cfg["moe_layer_freq"] == 1
    assert (cfg["topk_method"], cfg["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert cfg["kv_lora_rank"] == 32 and cfg["q_lora_rank"] == 32 and cfg["n_shared_experts"] == 1
    assert cfg["vocab_size"] == tiny.VOCAB_SIZE


def test_weights_proj_is_bf16_exact_and_tokenizer_is_glm53_tiny(ckpt):
    import torch
    from safetensors import safe_open
    from transformers import AutoTokenizer

    where = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(ckpt / where["model.layers.1.self_attn.indexer.weights_proj.weight"], "pt") as f:
        w = f.get_tensor("model.layers.1.self_attn.indexer.weights_proj.weight")
    assert "model.layers.1.self_attn.indexer.wk.weight" in where
    assert torch.equal(w, w.to(torch.bfloat16).float())  # SGLang holds it in bf16
    a, b = AutoTokenizer.from_pretrained(ckpt), AutoTokenizer.from_pretrained(tiny.ensure())
    assert a.get_vocab() == b.get_vocab() and a.chat_template == b.chat_template


def test_the_checkpoint_is_sharded_with_an_index_as_glm53s(ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards == sorted(p.name for p in ckpt.glob("model-*-of-*.safetensors"))
    assert not (ckpt / "model.safetensors").exists()
    assert {k.split(".")[2] for k in index["weight_map"] if k.startswith("model.layers.")} == {"0", "1", "2"}


@pytest.mark.parametrize("topology", ["single", "pd"])
def test_cpu_dsa_toml_serves_the_preset_with_64_token_pages(topology):
    assert dsa_tiny.PRESET in PRESETS
    topo = Topology.load(REPO_LAUNCH_DIR / "cpu.toml", topology)
    assert topo.model.preset == dsa_tiny.PRESET
    for cap in topo.capacities():
        assert cap.page_size == dsa_tiny.PAGE_SIZE and cap.kv_tokens % dsa_tiny.PAGE_SIZE == 0
    role = "single" if topology == "single" else "prefill"
    argv = topo.server_argv("/m", 1, role, 2)
    assert argv[argv.index("--page-size") + 1] == "64"


def test_a_sharded_checkpoint_is_generated_once(ckpt):
    def generate_again(out):
        raise AssertionError(f"regenerated an existing checkpoint into {out}")

    assert tiny.ensure_checkpoint(ckpt, generate_again) == ckpt

"""glm53-tiny, the embedded default model: a tiny random checkpoint of GLM-5.3's own architecture.

`GlmMoeDsaForCausalLM`: MLA latent attention, the DSA sparse indexer (index_topk small enough
that selection is really used on prompts of a few dozen tokens) and sigmoid-routed MoE with one
shared expert, generated locally from a fixed seed with the embedded tokenizer (models/tiny.py).
Serving it on CPU needs the patches of glm53_serving/cpu_dsa.py. Cached by recipe hash.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from glm53_serving.models import tiny

SEED = 20260815
RECIPE_VERSION = 2  # 2: sharded like GLM-5.3 (model-0000k-of-0000n.safetensors + index)
PRESET = "glm53-tiny"
INDEX_TOPK = 16
SHARD_BYTES = 400_000  # ~1.1 MB of weights: three shards and an index file, as GLM-5.3's checkpoint
PAGE_SIZE = 64  # DSA forces 64-token KV pages in SGLang

CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "glm53_preset": PRESET,  # checked against this recipe, not GLM-5.3's shape (glm53_serving/model.py)
    "model_type": "glm_moe_dsa",
    "vocab_size": tiny.VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "head_dim": 16,
    "index_topk": INDEX_TOPK,
    "index_head_dim": 128,  # SGLang's DSA pool asserts 128 (memory_pool.py DSATokenToKVPool)
    "index_n_heads": 4,
    # SGLang defaults the indexer to neox RoPE (models/deepseek_v2.py); HF's GLM-DSA is interleaved.
    "indexer_rope_interleave": True,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    # SGLang's DeepseekV2 construction needs these (deepseek_v2.py reads moe_layer_freq).
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "hidden_act": "silu",
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": None,
    "eos_token_id": 0,
    "pad_token_id": 0,
}


def recipe_hash() -> str:
    blob = json.dumps(
        {"v": RECIPE_VERSION, "seed": SEED, "config": CONFIG, "tokenizer": tiny.recipe_hash()}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_path() -> Path:
    return tiny.cache_root() / "models" / f"{PRESET}-{recipe_hash()}"


def ensure(path: Path | None = None) -> Path:
    """Return the checkpoint directory, generating it first if it is missing."""
    return tiny.ensure_checkpoint(Path(path) if path else default_path(), generate)


def generate(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    AutoTokenizer.from_pretrained(tiny.ensure()).save_pretrained(out)

    torch.manual_seed(SEED)
    skip = ("architectures", "model_type", "rope_theta", "moe_layer_freq", "topk_method", "scoring_func")
    cfg = GlmMoeDsaConfig(
        **{k: v for k, v in CONFIG.items() if k not in skip},
        rope_parameters={"rope_type": "default", "rope_theta": CONFIG["rope_theta"]},
    )
    for k in ("moe_layer_freq", "topk_method", "scoring_func", "indexer_rope_interleave"):
        setattr(cfg, k, CONFIG[k])
    cfg.architectures = CONFIG["architectures"]
    model = GlmMoeDsaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            # SGLang creates the indexer's weights_proj in bf16: bf16-exact weights load unchanged.
            w = layer.self_attn.indexer.weights_proj.weight
            w.copy_(w.to(torch.bfloat16).float())
        for layer in model.model.layers[cfg.first_k_dense_replace :]:
            # A non-zero routing bias, so the correction-bias path is exercised, not skipped.
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    # Sharded with model.safetensors.index.json, GLM-5.3's HF layout: SGLang loads through the index.
    model.save_pretrained(out, safe_serialization=True, max_shard_size=SHARD_BYTES)
    (out / "glm53_dsa_tiny.json").write_text(json.dumps({"recipe": recipe_hash(), "seed": SEED}) + "\n")


if __name__ == "__main__":
    print(ensure())

"""The GLM-5.3 model definition: SGLang's `GlmMoeDsaForCausalLM`, refusing checkpoints of another shape.

GLM-5.3 is `GlmMoeDsaForCausalLM` (MLA latent attention, the DSA sparse indexer with its fp8
index-key cache, sigmoid-routed MoE with a shared expert, 64-token KV pages). SGLang branches on
that exact architecture name in a dozen places (configs/model_config.py, arg_groups/overrides.py,
model_overrides/deepseek_v2.py, ...), so our class keeps it and subclasses SGLang's: everything
SGLang does for GLM-5.x still happens. What it adds is the check SGLang does not make: the
checkpoint has GLM-5.3's shape (`SHAPE`), so that a GLM-5.3-Flash (`glm5_next`) checkpoint or a
hand-edited config is refused at model construction, before any weight is read, with the field
named, instead of serving a model whose KV layout our capacity planning and KV guard assume
wrongly. Checkpoints of a preset we ship (config `glm53_preset`, models/dsa_tiny.py) are smaller
on purpose and are checked against their own recipe instead.

SGLang resolves it through `ModelRegistry.resolve_model_cls` (hooks.py row), in the scheduler
process that builds the model: other models resolve as upstream does, and a process that never
builds a GLM-5.x model never imports SGLang's DeepSeek modules through us.
"""

from __future__ import annotations

import functools
from typing import Any

ARCHITECTURE = "GlmMoeDsaForCausalLM"
# GLM-5.x's model card: up to 128K output tokens per request (of a 202,752-token window). The
# serving default for a GLM-5.3 checkpoint (topology.Topology.max_output_tokens).
MAX_OUTPUT_TOKENS = 131_072

# GLM-5.3's shape (transformers' GlmMoeDsaConfig defaults, documented as zai-org/GLM-5; a public
# serving report states GLM-5.3's config equals GLM-5.2's). The fields that fix the weights' and
# the KV pool's layout; context length, RoPE scaling and the like may differ.
SHAPE: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "num_hidden_layers": 78,
    "hidden_size": 6144,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "first_k_dense_replace": 3,
    "vocab_size": 154880,
}
# What every checkpoint of the architecture needs, presets included: SGLang's DSA pool asserts a
# 128-byte index head (memory_pool.py DSATokenToKVPool); DSA is on only where index_topk is set.
REQUIRED: dict[str, Any] = {"model_type": "glm_moe_dsa", "index_head_dim": 128}


class ModelShapeError(ValueError):
    """The checkpoint is not GLM-5.3's shape (or its preset's)."""


def presets() -> dict[str, dict[str, Any]]:
    """The presets we ship: name -> their config (models/)."""
    from glm53_serving.models import dsa_tiny

    return {dsa_tiny.PRESET: dsa_tiny.CONFIG}


def config_problems(config) -> list[str]:
    """Why `config` (a transformers config, or a dict) is not a GLM-5.3 checkpoint; [] when it is."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    missing = object()
    preset = get("glm53_preset")
    if preset is not None:
        shape = presets().get(preset)
        if shape is None:
            return [f"glm53_preset {preset!r} is not a preset of glm53_serving ({', '.join(presets())})"]
        shape = {k: v for k, v in shape.items() if k in SHAPE}
    else:
        shape = SHAPE
    problems = []
    for field, want in {**shape, **REQUIRED}.items():
        have = get(field, missing)
        if have is missing or have is None:
            problems.append(f"{field} is missing (GLM-5.3: {want})")
        elif have != want:
            problems.append(f"{field} is {have!r}, GLM-5.3's is {want!r}")
    return problems


def check_config(config) -> None:
    problems = config_problems(config)
    if problems:
        raise ModelShapeError(
            f"glm53_serving: this checkpoint is not GLM-5.3 ({ARCHITECTURE}): "
            + "; ".join(problems)
            + ". GLM-5.3-Flash (glm5_next) and other GLM-5.x variants are other models: serve them without "
            "glm53_serving, or with a topology that names them."
        )


@functools.cache
def model_class() -> type:
    """SGLang's GLM-5.x class, checking the checkpoint's shape first (built on first use: it
    imports SGLang's DeepSeek modules)."""
    from sglang.srt.models.glm4_moe import GlmMoeDsaForCausalLM as Upstream

    class GlmMoeDsaForCausalLM(Upstream):
        """SGLang's, after the checkpoint's shape was checked (glm53_serving.model)."""

        __module__ = __name__

        def __init__(self, config, *args, **kwargs):
            check_config(config)  # before any layer is built or weight read
            super().__init__(config, *args, **kwargs)

    return GlmMoeDsaForCausalLM


def resolve_model_hook(original, self, architectures, *args, **kwargs):
    """AROUND _ModelRegistry.resolve_model_cls: GLM-5.x resolves to our class; everything else
    as upstream."""
    first = architectures if isinstance(architectures, str) else (architectures or [None])[0]
    if first == ARCHITECTURE:
        return model_class(), ARCHITECTURE
    return original(self, architectures, *args, **kwargs)

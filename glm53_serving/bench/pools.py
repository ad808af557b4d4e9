"""SGLang's real DSA KV pool, built on CPU with a model's rows: what the KV guard's benchmarks and
unit tests zero, tag and check (the server builds it in kv_cache_configurator._build_dsa_kv_pool).

`shape` is a config dict: model.SHAPE (GLM-5.3: latent 512 + rope 64, bf16 -> 1,152 B per token
per layer) or models.dsa_tiny.CONFIG (glm53-tiny: 32 + 16). Index-K rows are 128 fp8 bytes and a
4-byte scale per token, whatever the model (SGLang's pool asserts index_head_dim 128).
"""

from __future__ import annotations

from typing import Any

import torch

PAGE = 64  # DSA's only page size


def dsa_pool(slots: int, layers: int, shape: dict[str, Any], dtype: torch.dtype = torch.bfloat16):
    """SGLang's DSATokenToKVPool with `slots` slots (a multiple of PAGE) of `layers` layers."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    if slots % PAGE:
        raise ValueError(f"slots must be a multiple of the {PAGE}-token page, got {slots}")
    latent, rope = shape["kv_lora_rank"], shape["qk_rope_head_dim"]
    return DSATokenToKVPool(
        size=slots,
        page_size=PAGE,
        kv_lora_rank=latent,
        dtype=dtype,
        qk_rope_head_dim=rope,
        layer_num=layers,
        device="cpu",
        index_head_dim=shape["index_head_dim"],
        enable_memory_saver=False,
        kv_cache_dim=latent + rope,  # bf16/fp32 latent: no fp8 packing (calculate_mla_kv_cache_dim)
        index_buf_size=slots,  # SGLang's default with one DCP rank
    )

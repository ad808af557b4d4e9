"""CPU compat stand-in for `sgl_kernel` (SGLang 0.5.23 on a machine without the CPU build).

The CPU build of sgl-kernel is not on PyPI, yet with SGLANG_USE_CPU_ENGINE=1 SGLang imports a
few of its CPU ops at module import. This package provides exactly those names:

- the ops on our serving path are implemented in plain PyTorch with the semantics of the
  kernels they replace (the Triton twins in SGLang are the reference, see each docstring);
- the speculative-decoding ops (not on our path: no speculative decoding on CPU) raise
  NotImplementedError naming the op when called.

Any other name raises AttributeError (so ImportError on `from sgl_kernel import x`): SGLang
guards optional kernels with try/except ImportError, and those guards must keep choosing their
native PyTorch fallbacks instead of a stub. `torch.ops.sgl_kernel` is not registered, so
`cpu_has_amx_support()` stays False and every layer takes its forward_native path.

Installed only by scripts/setup on CPU machines; never next to the real sglang-kernel.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+glm53.cpu.compat"
IS_GLM53_CPU_COMPAT = True

__all__ = [
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request i: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next
    end[i]-start[i] entries of out_cache_loc (requests consume it back to back).

    Reference: `assign_req_to_token_pool` (Triton) in sglang/srt/mem_cache/allocation.py.
    """
    assert req_to_token.shape[1] == pool_len, (req_to_token.shape, pool_len)
    lens = (end_offset - start_offset).to(torch.int64)
    if lens.numel() == 0 or int(lens.sum()) == 0:
        return
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), lens)
    # Position within each request's span: global index minus the span's start in out_cache_loc.
    span_start = torch.cumsum(lens, 0) - lens
    local = torch.arange(int(lens.sum()), device=lens.device) - torch.repeat_interleave(span_start, lens)
    cols = torch.repeat_interleave(start_offset.to(torch.int64), lens) + local
    req_to_token[rows, cols] = out_cache_loc[: int(lens.sum())].to(req_to_token.dtype)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every buffer b (base address data_ptrs[b], row size strides[b] bytes): copy row
    src_loc[j] to row tgt_loc[j] for all j. All source rows are read before any target row is
    written, so overlapping moves behave like the tiled kernel ("safe for in-place copy").

    Reference: `copy_all_layer_kv_cache_tiled` (Triton) in sglang/kernels/ops/kvcache/cache_move.py.
    """
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64).cpu()
    tgt = tgt_loc.to(torch.int64).cpu()
    rows = int(max(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        view = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        view[tgt] = view[src].clone()


def _not_on_cpu_path(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: this CPU compat package (glm53-cpu-compat) has no implementation "
            "of this op; it belongs to speculative decoding, which the CPU development stack does "
            "not support. Use a GPU install with the real sglang-kernel."
        )

    op.__name__ = op.__qualname__ = name
    return op


assign_draft_cache_locs_contiguous_cpu = _not_on_cpu_path("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _not_on_cpu_path("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _not_on_cpu_path("build_tree_kernel_efficient_cpu")
fill_accept_out_cache_loc_cpu = _not_on_cpu_path("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_on_cpu_path("fill_bonus_tokens_cpu")
verify_tree_greedy_cpu = _not_on_cpu_path("verify_tree_greedy_cpu")

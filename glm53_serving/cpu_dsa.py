"""GLM-5.x DSA models (`GlmMoeDsaForCausalLM`: MLA + DSA sparse indexer) on SGLang's CPU path.

Only DSA deployments on CPU exercise it: the embedded default glm53-tiny (launch/cpu.toml). Every function
here is the implementation of a `cpu_only=True` row of hooks.HOOKS, so it is never installed on
a CUDA process. The argument-resolution rows act only for DSA models, the torch_native rows
only when the DSA-only `topk_indices` argument is passed; the RoPE and MLA-dispatch rows change
what used to fail on CPU (unscaled RoPE through get_rope_cpu, any MLA model on torch_native) and
nothing that worked (glm53-tiny, GQA, goes through neither). Line numbers are of the pinned
sglang 0.5.23 wheel (sglang/srt/...).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from glm53_serving import batch_invariant

FP8_MAX = 448.0  # float8_e4m3fn
INDEX_SCALE_BYTES = 4  # one fp32 scale per token (index_head_dim == quant_block_size == 128)


# --- argument resolution -------------------------------------------------------------------


def _is_dsa(server_args) -> bool:
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.configs.model_config import is_deepseek_dsa

    try:
        return bool(is_deepseek_dsa(model_config_of(server_args).hf_config))
    except Exception:  # noqa: BLE001 - not resolvable here: not ours to change
        return False


@contextlib.contextmanager
def _no_cuda_capability():
    # torch.cuda.get_device_capability() raises without an NVIDIA driver; the DSA branch of
    # handle_model_specific_adjustments (arg_groups/model_hook.py:341) calls it and discards the
    # result on the CPU path (the overrides it runs next are answered by the rows below).
    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: (0, 0)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved


def model_adjustments_without_cuda(original, server_args, *args, **kwargs):
    """AROUND arg_groups.model_hook.handle_model_specific_adjustments (DSA models only)."""
    if not _is_dsa(server_args):
        return original(server_args, *args, **kwargs)
    with _no_cuda_capability():
        return original(server_args, *args, **kwargs)


def no_dsa_gpu_override(original, view, *args, **kwargs):
    """AROUND overrides._dsa_kv_cache_dtype_default and _dsa_split_backend_resolution: on CPU
    they would read the CUDA capability (overrides.py:512, :631), force a bf16/fp8 KV cache
    (:527-550) and pick GPU-only DSA kernels; the CPU path keeps the model dtype and
    --attention-backend torch_native."""
    return {}


# --- model construction ----------------------------------------------------------------------


def rope_cpu_plain_fallback(original, head_size, rotary_dim, max_position, base, is_neox_style=True, *args, **kw):
    """AROUND layers/rotary_embedding/factory.get_rope_cpu: it accepts only deepseek_yarn scaling
    (factory.py:478-482); GLM-5 uses plain RoPE for attention (models/deepseek_v2.py:2167) and the
    indexer (dsa_indexer.py:386). Without scaling the generic get_rope is the right one."""
    rope_scaling = args[0] if args else kw.get("rope_scaling")
    if rope_scaling is None or rope_scaling.get("rope_type", "default") == "default":
        from sglang.srt.layers.rotary_embedding.factory import get_rope

        dtype = args[1] if len(args) > 1 else kw.get("dtype")
        partial = args[2] if len(args) > 2 else kw.get("partial_rotary_factor", 1.0)
        return get_rope(head_size, rotary_dim, max_position, base, is_neox_style, None, dtype, partial)
    return original(head_size, rotary_dim, max_position, base, is_neox_style, *args, **kw)


def _torch_native_mla(attn, forward_batch):
    from sglang.srt.models.deepseek_common.attention_backend_handler import _dispatch_mla_subtype

    return _dispatch_mla_subtype(attn, forward_batch)


def torch_native_mla_handler(original, cls, backend_name):
    """AROUND AttentionBackendRegistry.get_handler: torch_native has no MLA handler and falls back
    to triton's (attention_backend_handler.py:55), whose MHA prefill attends over a pool that holds
    the one-head latent (forward_mha.py:310, torch_native_backend.py:315: shape error). The
    absorbed MLA path works with torch_native."""
    if backend_name == "torch_native":
        return _torch_native_mla
    return original(cls, backend_name)


# --- the DSA indexer: a pure-PyTorch forward -------------------------------------------------


def quantize_index_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 keys with one power-of-two fp32 scale per row (block 128): the torch twin of
    SGLang's act_quant(..., scale_fmt="ue8m0") (kernels/ops/quantization/act_quant_triton.py)."""
    k = k.float()
    amax = k.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (k / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.squeeze(-1)


def write_index_k(buf: torch.Tensor, loc: torch.Tensor, k_fp8: torch.Tensor, scale: torch.Tensor, page: int) -> None:
    """Store keys at token slots `loc` in one layer's index-K buffer, SGLang's layout
    (mem_cache/index_key_cache.py): per page row, `page` x head_dim fp8 bytes, then `page` fp32
    scales."""
    dim = k_fp8.shape[-1]
    flat = buf.view(-1)
    row = buf.shape[1]
    base = (loc // page) * row
    off = loc % page
    kpos = (base + off * dim)[:, None] + torch.arange(dim, device=buf.device)
    flat[kpos.reshape(-1)] = k_fp8.view(torch.uint8).reshape(-1)
    spos = (base + page * dim + off * INDEX_SCALE_BYTES)[:, None] + torch.arange(INDEX_SCALE_BYTES, device=buf.device)
    flat[spos.reshape(-1)] = scale.float().contiguous().view(torch.uint8).reshape(-1)


def read_index_k(buf: torch.Tensor, loc: torch.Tensor, dim: int, page: int) -> torch.Tensor:
    """The dequantised keys at token slots `loc` (fp32, [n, dim])."""
    flat = buf.view(-1)
    row = buf.shape[1]
    base = (loc // page) * row
    off = loc % page
    kpos = (base + off * dim)[:, None] + torch.arange(dim, device=buf.device)
    k = flat[kpos].view(torch.float8_e4m3fn).float()
    spos = (base + page * dim + off * INDEX_SCALE_BYTES)[:, None] + torch.arange(INDEX_SCALE_BYTES, device=buf.device)
    scale = flat[spos].contiguous().view(torch.float32)  # [n, 1]
    return k * scale


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def _select(scores: torch.Tensor, q_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k causal key positions per query ([n_q, topk] int32, -1 padded)."""
    n_kv = scores.shape[-1]
    causal = torch.arange(n_kv, device=scores.device)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    k = min(topk, n_kv)
    # Ties broken toward earlier positions (a stable sort), not left to topk's order: with a
    # ReLU per head, keys that no head scores above zero tie at exactly 0.
    val, idx = scores.sort(dim=-1, descending=True, stable=True)
    val, idx = val[:, :k], idx[:, :k]
    idx = idx.masked_fill(val == float("-inf"), -1).to(torch.int32)
    if k < topk:
        idx = F.pad(idx, (0, topk - k), value=-1)
    return idx


def indexer_forward_cpu(self, x, q_lora, positions, forward_batch, layer_id, return_indices=True, **_):
    """REPLACE Indexer.forward_native (dsa_indexer.py:1888 raises; forward_cuda refuses non-GPU
    devices at :2245 and needs deep_gemm, triton act_quant and SetKAndS kernels). Same inputs and
    result as forward_cuda: q/k from wq_b/wk, LayerNorm, RoPE on the first rope_head_dim dims, the
    keys quantised to fp8 in the pool's index-K pages, then per query the top-k cached positions
    by ReLU(q.k) weighted over heads (logical positions in the request, -1 padded)."""
    from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

    pool = get_token_to_kv_pool()
    page = pool.page_size
    n_tok = x.shape[0]
    q = self.wq_b(q_lora)[0].float().view(n_tok, self.n_heads, self.head_dim)
    k = self.wk(x)[0].float()
    k = F.layer_norm(
        k, (self.head_dim,), self.k_norm.weight.float(), self.k_norm.bias.float(), self.k_norm.variance_epsilon
    )
    cos, sin = self.rotary_emb.cos_sin_cache[positions].float().chunk(2, dim=-1)
    r = self.rope_head_dim
    neox = self.is_neox_style
    q = torch.cat([_rope(q[..., :r], cos[:, None], sin[:, None], neox), q[..., r:]], dim=-1)
    k = torch.cat([_rope(k[..., :r], cos, sin, neox), k[..., r:]], dim=-1)

    buf = pool.get_index_k_with_scale_buffer(layer_id=layer_id)
    k_fp8, k_scale = quantize_index_k(k)
    write_index_k(buf, forward_batch.out_cache_loc, k_fp8, k_scale, page)
    if not return_indices:
        return None

    # The bf16 weights_proj (dsa_indexer.py:372) computed in fp32.
    weights = F.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads**-0.5
    req_to_token = get_req_to_token_pool().req_to_token
    seq_lens = forward_batch.seq_lens_cpu.tolist()
    if forward_batch.forward_mode.is_decode_or_idle():
        q_lens = [1] * len(seq_lens)
    else:
        q_lens = forward_batch.extend_seq_lens_cpu
    out = torch.full((n_tok, self.index_topk), -1, dtype=torch.int32, device=x.device)
    width = _key_width(req_to_token)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        end = start + q_len
        locs = req_to_token[forward_batch.req_pool_indices[i], :seq_len].long()
        keys = _pad_rows(read_index_k(buf, locs, self.head_dim, page), width)  # [S or width, D]
        s = F.relu(torch.einsum("thd,sd->ths", q[start:end], keys) * self.softmax_scale)
        scores = torch.einsum("th,ths->ts", weights[start:end], s)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=x.device)
        out[start:end] = _select(scores, q_pos, self.index_topk)
        start = end
    return out


def _key_width(req_to_token: torch.Tensor) -> int | None:
    """With batch invariance on, every request attends over the same number of key slots, its
    real ones then zeros (masked): a row reduced over seq_len elements rounds differently from
    one over more, so a token's KV computed at a decode step (seq_len keys) would differ in its
    last bits from the same token recomputed in a prefill (a retracted request, a session's
    next turn). The width is the server's longest request row, the same for every forward."""
    return req_to_token.shape[1] if batch_invariant.active() else None


def _pad_rows(t: torch.Tensor, width: int | None) -> torch.Tensor:
    return t if width is None else F.pad(t, (0, 0, 0, width - t.shape[0]))


# --- sparse MLA in the torch_native backend --------------------------------------------------


def _sparse_mla(backend, q, k, v, layer, forward_batch, save_kv_cache, topk_indices, decode: bool):
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v
        )
    heads = layer.tp_q_head_num
    q_ = q.reshape(-1, heads, layer.qk_head_dim)
    o = q_.new_empty((q_.shape[0], heads, layer.v_head_dim))
    kv = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)  # [slots, 1, kv_lora + rope]
    req_to_token = backend.req_to_token_pool.req_to_token
    seq_lens = forward_batch.seq_lens_cpu.tolist()
    q_lens = [1] * len(seq_lens) if decode else forward_batch.extend_seq_lens_cpu
    width = _key_width(req_to_token)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        end = start + q_len
        locs = req_to_token[forward_batch.req_pool_indices[i], :seq_len].long()
        keys = _pad_rows(kv[locs, 0].to(q_.dtype), width)  # [S, D]; S = seq_len, or width
        values = keys[:, : layer.v_head_dim]
        n = keys.shape[0]
        idx = topk_indices[start:end].long()
        allowed = torch.zeros((q_len, n + 1), dtype=torch.bool, device=q.device)
        allowed.scatter_(1, torch.where(idx < 0, n, idx), True)  # -1 lands in a spare column
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = allowed[:, :n] & (torch.arange(n, device=q.device)[None, :] <= q_pos[:, None])
        out = F.scaled_dot_product_attention(
            q_[start:end].transpose(0, 1),  # [H, T, D]
            keys[None].expand(heads, -1, -1),
            values[None].expand(heads, -1, -1),
            attn_mask=mask[None],
            scale=layer.scaling,
        )
        o[start:end] = out.transpose(0, 1)
        start = end
    return o.reshape(-1, heads * layer.v_head_dim)


def sparse_extend(original, self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND TorchNativeAttnBackend.forward_extend: the MLA forward passes the DSA selection as
    `topk_indices=` (forward_mla.py:792-799), which the dense torch_native backend does not take
    (torch_native_backend.py:279, TypeError). With it: attend to the causal AND selected
    positions of each request's latent cache. Without it: upstream, unchanged."""
    topk_indices = kwargs.pop("topk_indices", None)
    if topk_indices is None:
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    return _sparse_mla(self, q, k, v, layer, forward_batch, save_kv_cache, topk_indices, decode=False)


def sparse_decode(original, self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND TorchNativeAttnBackend.forward_decode (torch_native_backend.py:338): as sparse_extend."""
    topk_indices = kwargs.pop("topk_indices", None)
    if topk_indices is None:
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    return _sparse_mla(self, q, k, v, layer, forward_batch, save_kv_cache, topk_indices, decode=True)


# --- PD decode retraction: the DSA pool's host backup -------------------------------------


def _no_op(*args, **kwargs) -> None:
    return None


def host_copy_without_cuda_sync(original, self, *args, **kwargs):
    """AROUND DSATokenToKVPool.get_cpu_copy / load_cpu_copy (decode retraction's `cpu_tensor`
    backup): they and the index-K cache's copies (mem_cache/memory_pool.py:5632, :5654;
    index_key_cache.py:144-175) call `torch.cuda.synchronize()`, which raises without CUDA. On a
    CPU device every copy is already complete when it returns, so the barrier has nothing to wait
    for; the MLA part synchronises through `current_platform`, which is right on CPU already."""
    sync = torch.cuda.synchronize
    torch.cuda.synchronize = _no_op
    try:
        return original(self, *args, **kwargs)
    finally:
        torch.cuda.synchronize = sync

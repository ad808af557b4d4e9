"""HF transformers' GlmMoeDsaForCausalLM as the reference for glm53-tiny, with the DSA
indexer's keys quantised to fp8 as SGLang's CPU path stores them.

Stock HF keeps the indexer keys in full precision; SGLang stores them in the fp8 index-K cache
(a power-of-two scale per token), which changes the top-k selection once a sequence is longer
than index_topk. The patched indexer below is HF's forward with that one quantisation added
(glm53_serving.cpu_dsa.quantize_index_k, the torch twin of SGLang's act_quant) and the same
tie-break as the CPU indexer (earlier positions first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm53_serving.cpu_dsa import quantize_index_k


def _fp8_indexer_forward(
    self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, past_key_values=None
):
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    batch_size, seq_len, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(batch_size, seq_len, self.n_heads, self.head_dim)
    q_rot, q_pass = torch.split(q, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    if past_key_values is not None:
        raise ValueError("the reference recomputes the whole sequence each step (use_cache=False)")
    k_fp8, scale = quantize_index_k(k)
    k = k_fp8.float() * scale.unsqueeze(-1)  # what the index-K cache gives back
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale)
    weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * (self.n_heads**-0.5)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
    else:
        index_scores = index_scores + attention_mask
    topk = min(self.index_topk, index_scores.shape[-1])
    # Ties toward earlier positions, as glm53_serving.cpu_dsa selects (topk's order among equal
    # scores is unspecified; keys no head scores above zero tie at exactly 0).
    return index_scores.sort(dim=-1, descending=True, stable=True).indices[..., :topk].to(torch.int32)


def load(path, fp8_index_keys: bool = True):
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    if fp8_index_keys:
        for layer in model.model.layers:
            indexer = layer.self_attn.indexer
            if indexer is not None:
                indexer.forward = _fp8_indexer_forward.__get__(indexer)
    return model


def greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids`, recomputing the whole sequence each step (no cache)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(x, use_cache=False).logits[0, -1].argmax()
            x = torch.cat([x, nxt.view(1, 1)], dim=1)
    return x[0, -n:].tolist()

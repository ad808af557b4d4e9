"""Capacity: can each server's GPUs back the KV pool its topology file asks for, as SGLang 0.5.23 sizes it?

`python -m glm53_serving.plan --config launch/FILE [--topology single|pd] [--json]`: per role, the
KV bytes per token, the weights per GPU, the pool SGLang will allocate and a verdict (exit 0: every
role fits; 2: refused, with what would fit). The launcher runs `check()` before starting anything.

Why: SGLang sizes the pool from memory after loading the weights and silently caps it at
--max-total-tokens (our kv_tokens); a kv_tokens larger than what fits is only a warning and the
server runs with a smaller pool than the file (and its advertised window) assumes: the incident's
"1,048,576-token window over a 681,280-token pool". Formula (SGLang 0.5.23 file:line, sglang/srt/):
    pre    = free GPU memory after CUDA/NCCL init        distributed/bootstrap.py:193-217
    rest   = free after weights - pre * (1 - fraction)   mem_cache/kv_cache_configurator.py:2990-3060
           = pre * fraction - weights
    tokens = rest // cell_size // page_size * page_size  model_executor/pool_configurator.py:637-646
    cell_size: pool_configurator.py:340-535 (+ the DSA indexer, :560-627), reproduced in kv_cell().
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from glm53_serving.admission import Limits
from glm53_serving.model import SHAPE
from glm53_serving.topology import AdmissionConf, Topology, default_config_path

GiB = 1 << 30
# CUDA context, NCCL communicators (NVLS and the custom all-reduce buffers for TP8) and cuBLAS /
# DeepGEMM workspaces are taken before SGLang's memory baseline (bootstrap.py:193-217), so the
# pool's share is fraction x (total - this). A torch CUDA context is ~0.5-1 GiB on Hopper; NCCL with
# NVLS at TP8 takes ~1-2 GiB more. 3 GiB is the upper end: the planner must not promise a pool a
# server cannot allocate (SGLang would then shrink it with only a warning).
CUDA_CONTEXT_NCCL_BYTES = 3 * GiB
NODE_GPUS = 8  # an HGX H100/H200 node
MAX_FRACTION = 0.95  # above this, activations and CUDA graphs have no room (memory_hook.py:281-325)


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    memory_bytes: int  # what torch.cuda.get_device_properties().total_memory reports
    sm_major: int  # picks SGLang's default KV dtype and DSA kernels (arg_groups/overrides.py:531, :710-724)


# Total memory as torch reports it ("GPU 0 has a total capacity of ... GiB" in its OOM messages;
# nvidia-smi shows more: H200 143,771 MiB, H100 81,559 MiB, part of which the driver keeps).
GPUS = {
    "H100": Gpu("H100", int(79.11 * GiB), 9),  # H100 SXM 80 GB
    "H200": Gpu("H200", int(139.81 * GiB), 9),  # H200 SXM 141 GB
}

# GLM-5.3's shape when no checkpoint is on disk: transformers' GlmMoeDsaConfig defaults (documented
# as zai-org/GLM-5; GLM-5.3's config equals GLM-5.2's), with the official FP8 (128x128 block) weights
# and one MTP layer.
GLM53_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    **SHAPE,  # what fixes the weights' and the KV pool's layout (model.py checks checkpoints against it)
    "intermediate_size": 12288,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 202752,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}

DTYPE_BYTES = {"fp8": 1, "bfloat16": 2, "float16": 2, "float32": 4}
QUANT_BLOCK = 128  # DSATokenToKVPool.quant_block_size (mem_cache/memory_pool.py:5280)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class Shape:
    """What capacity depends on, read once from a model config (config.json or a preset's dict)."""

    cfg: dict
    source: str  # where it came from (a checkpoint's config.json, a preset, GLM-5.3's known shape)
    checkpoint_bytes: int | None = None  # the safetensors index's metadata.total_size

    def __post_init__(self):
        for key in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads"):
            if not isinstance(self.cfg.get(key), int) or self.cfg[key] <= 0:
                raise ValueError(f"{self.source}: model config needs a positive {key}")
        if self.dsa and self.cfg.get("index_head_dim") != 128:
            raise ValueError(f"{self.source}: index_head_dim must be 128 (SGLang's DSA pool asserts it)")

    def __getitem__(self, key: str):
        return self.cfg.get(key) or 0

    @property
    def mla(self) -> bool:
        return bool(self.cfg.get("kv_lora_rank"))

    @property
    def dsa(self) -> bool:  # configs/model_config.py:191-212: a DSA architecture with index_topk set
        return self.mla and self.cfg.get("index_topk") is not None

    @property
    def layers(self) -> int:  # the target pool: MTP layers only with speculative decoding
        return self["num_hidden_layers"]

    @property
    def indexer_layers(self) -> int:
        """Layers with an index-K buffer: shared-top-k layers get 0 rows (index_key_cache.py:55-58,
        their count: model_config.py:488-523 dsa_layer_skips_topk, pool_configurator.py:619-624)."""
        n = self.layers
        types = self.cfg.get("indexer_types")
        if types is not None:
            return sum(1 for i in range(n) if not (i < len(types) and types[i] == "shared"))
        freq = self.cfg.get("index_topk_freq") or 1
        offset = self.cfg.get("index_skip_topk_offset")
        skips = (lambda i: max(i - offset + 1, 0) % freq != 0) if offset else (lambda i: max(i - 1, 0) % freq != 0)
        return sum(1 for i in range(n) if not skips(i))

    @property
    def weight_dtype(self) -> str:
        quant = (self.cfg.get("quantization_config") or {}).get("quant_method")
        if quant == "fp8":
            return "fp8"
        if quant:
            raise ValueError(f"{self.source}: the planner knows bf16/fp32 and FP8 weights, not {quant!r}")
        return str(self.cfg.get("torch_dtype") or self.cfg.get("dtype") or "bfloat16")


def model_shape(topo: Topology) -> Shape:
    """The checkpoint's config.json when [model] path exists here, a preset's generator dict, or
    GLM-5.3's known shape (a production file planned away from the GPU nodes)."""
    m = topo.model
    if m.preset is not None:
        from glm53_serving.models import dsa_tiny, tiny

        cfg = dsa_tiny.CONFIG if m.preset == dsa_tiny.PRESET else tiny.CONFIG
        return Shape(dict(cfg), f"preset {m.preset}")
    path = Path(m.path)
    if (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        index = path / "model.safetensors.index.json"
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size") if index.is_file() else None
        return Shape(cfg, str(path / "config.json"), int(total) if total else None)
    return Shape(dict(GLM53_CONFIG), f"GLM-5.3's known shape ({path} is not on this machine)")


# --- KV bytes per token --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cell:
    """Bytes one token takes in one GPU's pool (SGLang's cell_size)."""

    latent: int  # MLA latent rows (or MHA K+V) over all layers of the pool
    index: int  # the DSA indexer's fp8 keys + fp32 scales over its layers
    draft: int = 0  # the MTP draft's layers (speculative decoding only)

    @property
    def total(self) -> int:
        return self.latent + self.index + self.draft


def kv_dtype(topo: Topology, role: str, shape: Shape, gpu: Gpu | None) -> str:
    """The pool's dtype: --kv-cache-dtype, else SGLang's default for the model and GPU."""
    flag = topo.flag_value(role, "--kv-cache-dtype") or "auto"
    named = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "bf16": "bfloat16", "bfloat16": "bfloat16"}
    if flag in named:
        if shape.dsa and flag == "fp8_e5m2":
            raise ValueError(f"[{role}] --kv-cache-dtype fp8_e5m2: DSA takes bfloat16 or fp8_e4m3 (overrides.py:538)")
        return named[flag]
    if flag != "auto":
        raise ValueError(f"[{role}] --kv-cache-dtype {flag}: the planner knows auto, bf16 and fp8_e4m3")
    if shape.dsa and topo.device == "cuda":  # overrides.py:531-537: fp8 from Blackwell (SM100) on
        return "fp8" if gpu is not None and gpu.sm_major >= 10 else "bfloat16"
    model_dtype = topo.model.dtype or shape.weight_dtype
    return "bfloat16" if model_dtype in ("fp8", "auto") else model_dtype


def raw_fp8_layout(topo: Topology, role: str, gpu: Gpu | None) -> bool:
    """Whether this role's DSA kernels read the raw MLA row instead of the packed fp8 row
    (kv_cache_configurator.py:3426-3455: trtllm for the role, or tilelang for both)."""
    sm = gpu.sm_major if gpu is not None else 9
    default = "trtllm" if sm >= 10 else "flashmla_kv"  # fp8 defaults, overrides.py:710-716
    prefill = topo.flag_value(role, "--dsa-prefill-backend") or default
    decode = topo.flag_value(role, "--dsa-decode-backend") or default
    uses = {"prefill": prefill == "trtllm", "decode": decode == "trtllm"}.get(role, "trtllm" in (prefill, decode))
    return uses or prefill == decode == "tilelang"


def kv_cell(shape: Shape, dtype: str, *, raw_fp8: bool = False, attn_tp: int = 1, pp: int = 1, draft: int = 0) -> Cell:
    """SGLang's cell_size (pool_configurator.py:340-535) for the pool of one GPU."""
    layers = _ceil_div(shape.layers, pp)  # the largest pipeline stage
    size = DTYPE_BYTES[dtype]
    if not shape.mla:  # MHA: heads split over attention TP, at least one per GPU (model_config.py:1700-1711)
        heads = max(1, (shape["num_key_value_heads"] or shape["num_attention_heads"]) // attn_tp)
        head_dim = shape["head_dim"] or shape["hidden_size"] // shape["num_attention_heads"]
        per_layer = heads * (head_dim + (shape["v_head_dim"] or head_dim)) * size
        return Cell(per_layer * layers, 0, per_layer * draft)
    # MLA: one latent head, the same on every TP rank (TP replicates it). With fp8, GLM-5.x's DSA
    # pool packs 512 fp8 + 4-byte scales per 128 + the 64-dim rope in bf16 (calculate_mla_kv_cache_dim,
    # kv_cache_configurator.py:3457-3473) unless the kernels read the raw row.
    rank, rope = shape["kv_lora_rank"], shape["qk_rope_head_dim"]
    row = rank + rope
    if shape.dsa and dtype == "fp8" and not raw_fp8:
        row = rank + rank // QUANT_BLOCK * 4 + rope * 2
    index_per_layer = 0
    if shape.dsa:  # 128 fp8 key bytes + one fp32 scale per 128 (pool_configurator.py:566-572, index_kpool 1)
        head = shape["index_head_dim"]
        index_per_layer = head + head // QUANT_BLOCK * 4
    latent_per_layer = row * size
    # The MTP draft has its own latent rows and an indexer on every draft layer (pool_configurator.py:272-309).
    draft_bytes = draft * (latent_per_layer + index_per_layer)
    return Cell(latent_per_layer * layers, index_per_layer * _ceil_div(shape.indexer_layers, pp), draft_bytes)


# --- weights per GPU -----------------------------------------------------------------------------


def _linear(out: int, inp: int, dtype: str) -> int:
    if dtype == "fp8":  # 1 byte a weight + one fp32 scale per 128x128 block (weight_scale_inv)
        return out * inp + _ceil_div(out, 128) * _ceil_div(inp, 128) * 4
    return out * inp * DTYPE_BYTES[dtype]


def _layer_weights(s: Shape, moe: bool, w: str, plain: str) -> tuple[int, int, int]:
    """(replicated, split over attention TP, split over TP) bytes of one decoder layer."""
    h, heads = s["hidden_size"], s["num_attention_heads"]
    norms = 2 * h * DTYPE_BYTES[plain]
    if s.mla:
        nope, rope, v, q_rank, kv_rank = (
            s["qk_nope_head_dim"],
            s["qk_rope_head_dim"],
            s["v_head_dim"],
            s["q_lora_rank"],
            s["kv_lora_rank"],
        )
        q_in = q_rank or h
        # SGLang replicates the fused q_a/kv_a projection and the indexer (ReplicatedLinear,
        # layers/attention/dsa/dsa_indexer.py:344-371); q_b, kv_b and o are split over attention TP.
        replicated = _linear(kv_rank + rope, h, w) + (_linear(q_rank, h, w) if q_rank else 0)
        replicated += (q_rank + kv_rank) * DTYPE_BYTES[plain]
        if s.dsa:
            ih, ihd = s["index_n_heads"], s["index_head_dim"]
            replicated += _linear(ih * ihd, q_in, w) + _linear(ihd, h, w) + (ih * h + 2 * ihd) * DTYPE_BYTES[plain]
        split_attn = _linear(heads * (nope + rope), q_in, w) + _linear(heads * (nope + v), kv_rank, w)
        split_attn += _linear(h, heads * v, w)
    else:
        hd = s["head_dim"] or h // heads
        kv = s["num_key_value_heads"] or heads
        replicated = 0
        split_attn = _linear((heads + 2 * kv) * hd, h, w) + _linear(h, heads * hd, w)
    if moe:
        experts = s["n_routed_experts"] + s["n_shared_experts"]
        split = experts * 3 * _linear(s["moe_intermediate_size"], h, w)
        replicated += s["n_routed_experts"] * h * DTYPE_BYTES[plain] + s["n_routed_experts"] * 4  # router + bias
    else:
        split = 3 * _linear(s["intermediate_size"], h, w)
    return replicated + norms, split_attn, split


def weight_bytes(shape: Shape, tp: int = 1, attn_tp: int = 1, draft: bool = False) -> tuple[int, int]:
    """(the checkpoint's bytes, bytes each GPU holds) from the shape. Embedding and lm_head are
    vocab-parallel over TP; routed experts are split over TP whether by expert (--ep-size) or within
    each expert (ep x moe-tp = tp in 0.5.23), so per GPU they are total / tp either way."""
    w = shape.weight_dtype
    plain = "bfloat16" if w == "fp8" else w  # embeddings, norms and the router stay unquantized
    moe_from = shape["first_k_dense_replace"] if shape["n_routed_experts"] else shape.layers
    rep = attn = split = 0
    for i in range(shape.layers):
        r, a, m = _layer_weights(shape, i >= moe_from, w, plain)
        rep, attn, split = rep + r, attn + a, split + m
    vocab = shape["vocab_size"] * shape["hidden_size"] * DTYPE_BYTES[plain]
    split += vocab * (1 if shape.cfg.get("tie_word_embeddings") else 2)
    rep += shape["hidden_size"] * DTYPE_BYTES[plain]
    # MTP layers: on disk always; loaded only as a speculative draft (deepseek_weight_loader.py:336-346).
    h = shape["hidden_size"]
    mtp_r, mtp_a, mtp_s = _layer_weights(shape, bool(shape["n_routed_experts"]), w, plain)
    mtp_r += _linear(h, 2 * h, plain) + 3 * h * DTYPE_BYTES[plain]
    nextn = shape["num_nextn_predict_layers"]
    total = rep + attn + split + nextn * (mtp_r + mtp_a + mtp_s)
    per_gpu = rep + attn // attn_tp + split // tp
    if draft:
        per_gpu += nextn * (mtp_r + mtp_a // attn_tp + mtp_s // tp)
    return total, per_gpu


# --- the plan ------------------------------------------------------------------------------------


@dataclass(slots=True)
class RolePlan:
    role: str
    servers: int
    gpus: int  # per server
    kv_dtype: str
    cell: Cell
    weights_per_gpu: int | None = None
    gpu_bytes: int | None = None
    fraction: float | None = None
    capacity: int | None = None  # tokens SGLang's pool will hold on one (attention-DP) rank
    tp: int = 1
    pp: int = 1
    attn_dp: int = 1
    kv_tokens: int = 0
    verdict: str = "OK"  # OK | REFUSED | UNCHECKED
    why: str = ""
    fixes: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.verdict not in ("OK", "REFUSED", "UNCHECKED"):
            raise ValueError(f"verdict must be OK, REFUSED or UNCHECKED, not {self.verdict!r}")


@dataclass(slots=True)
class Plan:
    source: str
    topology: str
    device: str
    gpu: str | None
    model: str
    roles: list[RolePlan]
    window: int | None = None  # the advertised context (admission_plan)
    limits: Limits | None = None
    window_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.window_error is None and all(r.verdict == "OK" for r in self.roles)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        for r, d in zip(self.roles, out["roles"]):
            d["kv_bytes_per_token"] = r.cell.total
        out["limits"] = None if self.limits is None else dataclasses.asdict(self.limits)
        out["ok"] = self.ok
        return out


def gpu_of(topo: Topology) -> Gpu | None:
    if topo.gpu_memory_gib is not None:
        base = GPUS.get(topo.gpu or "")
        return Gpu(topo.gpu or "custom", int(topo.gpu_memory_gib * GiB), base.sm_major if base else 9)
    if topo.gpu is None:
        return None
    if topo.gpu not in GPUS:
        raise ValueError(f"gpu = {topo.gpu!r}: the planner knows {sorted(GPUS)}; set gpu_memory_gib for others")
    return GPUS[topo.gpu]


def _int_flag(topo: Topology, role: str, *flags: str) -> int:
    value = topo.flag_value(role, *flags)
    try:
        return int(value) if value is not None else 1
    except ValueError:
        raise ValueError(f"[{role}] {flags[0]} {value!r} is not a number") from None


def _capacity(gpu_bytes: int, fraction: float, weights: int, cell: int, page: int) -> int:
    rest = int((gpu_bytes - CUDA_CONTEXT_NCCL_BYTES) * fraction) - weights
    return max(0, rest) // cell // page * page


def plan_role(topo: Topology, role: str, shape: Shape, gpu: Gpu | None) -> RolePlan:
    tp = _int_flag(topo, role, "--tp-size", "--tp")
    pp = _int_flag(topo, role, "--pp-size", "--pp")
    attn_dp = _int_flag(topo, role, "--attn-dp-size")
    if tp % attn_dp:
        raise ValueError(f"[{role}] --attn-dp-size {attn_dp} must divide --tp-size {tp}")
    attn_tp = tp // attn_dp
    spec = topo.flag_value(role, "--speculative-algorithm")
    draft = shape["num_nextn_predict_layers"] if spec else 0
    dtype = kv_dtype(topo, role, shape, gpu)
    raw = topo.device == "cuda" and raw_fp8_layout(topo, role, gpu)
    cell = kv_cell(shape, dtype, raw_fp8=raw, attn_tp=attn_tp, pp=pp, draft=draft)
    servers = 1 if role == "single" else getattr(topo, role).count
    out = RolePlan(role, servers, topo.gpus_per_server(role), dtype, cell, tp=tp, pp=pp, attn_dp=attn_dp)
    out.kv_tokens = topo.role_value(role, "kv_tokens")
    total, per_gpu = weight_bytes(shape, tp, attn_tp, draft=bool(draft))
    if shape.checkpoint_bytes:  # the file's real size, split as the shape says
        per_gpu = per_gpu * shape.checkpoint_bytes // total
    out.weights_per_gpu = per_gpu // pp
    if topo.device != "cuda":
        out.why = "device cpu: the GPU memory check is skipped"
        return out
    fraction = topo.flag_value(role, "--mem-fraction-static")
    if gpu is None or fraction is None:
        out.verdict = "UNCHECKED"
        out.why = (
            "no GPU memory: set gpu (" + ", ".join(GPUS) + ") or gpu_memory_gib"
            if gpu is None
            else "no --mem-fraction-static: SGLang would derive one from graph sizes; set it"
        )
        return out
    out.gpu_bytes, out.fraction = gpu.memory_bytes, float(fraction)
    page = topo.role_value(role, "page_size") or 1
    out.capacity = _capacity(gpu.memory_bytes, out.fraction, out.weights_per_gpu, cell.total, page)
    if out.capacity >= out.kv_tokens:
        return out
    out.verdict = "REFUSED"
    out.why = (
        f"kv_tokens {out.kv_tokens:,} > the {out.capacity:,} tokens SGLang can allocate "
        f"(SGLang would cap the pool there with only a warning, kv_cache_configurator.py:3090-3104)"
    )
    out.fixes = _fixes(topo, shape, gpu, out, raw=raw, draft=draft, page=page)
    return out


def _fixes(topo: Topology, shape: Shape, gpu: Gpu, out: RolePlan, *, raw: bool, draft: int, page: int) -> list[str]:
    """What would fit, each alone: the pool that fits (and the window it gives), fp8 KV, a higher
    memory fraction, more GPUs a server."""
    tp, pp, attn_tp = out.tp, out.pp, out.tp // out.attn_dp
    fixes = [f"kv_tokens = {out.capacity:,} fits ({_fitted_window(topo, out.role, out.capacity)})"]
    fp8 = kv_cell(shape, "fp8", raw_fp8=raw, attn_tp=attn_tp, pp=pp, draft=draft)
    if out.kv_dtype != "fp8":
        cap = _capacity(gpu.memory_bytes, out.fraction, out.weights_per_gpu, fp8.total, page)
        fits = "fits" if cap >= out.kv_tokens else "not enough alone"
        fixes.append(f"--kv-cache-dtype fp8_e4m3: {fp8.total:,} B/token, {cap:,} tokens ({fits})")
    need = (out.weights_per_gpu + out.kv_tokens * out.cell.total) / (gpu.memory_bytes - CUDA_CONTEXT_NCCL_BYTES)
    if need <= MAX_FRACTION:
        fixes.append(f"--mem-fraction-static {math.ceil(need * 100) / 100:.2f} fits")
    for cell, label in ((out.cell, out.kv_dtype), (fp8, "fp8")):
        for more in (2 * tp, 4 * tp):
            _, w = weight_bytes(shape, more, more // out.attn_dp, draft=bool(draft))
            if shape.checkpoint_bytes:
                w = w * shape.checkpoint_bytes // weight_bytes(shape)[0]
            cap = _capacity(gpu.memory_bytes, out.fraction, w // pp, cell.total, page)
            if cap >= out.kv_tokens:
                spans = (
                    f" (more than one {NODE_GPUS}-GPU node: a server spanning nodes, --nnodes, is refused by "
                    "server_flags.py)"
                    if more * pp > NODE_GPUS
                    else ""
                )
                fixes.append(f"--tp-size {more} ({more * pp} GPUs a server) with {label} KV: {cap:,} tokens{spans}")
                break
        else:
            continue
        break
    return fixes


def _fitted_window(topo: Topology, role: str, kv_tokens: int) -> str:
    """The window and limits with this role's pool at `kv_tokens`: Topology.admission_plan's own
    answer (clamped), not a second formula."""
    if kv_tokens <= 0:
        return "no pool at all"
    conf = "worker" if role == "single" else role
    fitted = dataclasses.replace(
        topo,
        **{conf: dataclasses.replace(getattr(topo, conf), kv_tokens=kv_tokens)},
        admission=AdmissionConf(clamp_context_to_kv=True, clip_output=topo.admission.clip_output),
    )
    try:
        window, limits = fitted.admission_plan()
    except ValueError as e:
        return f"but {e}"
    return f"window {window:,}, prompts up to {limits.max_prompt_tokens:,} tokens"


def plan(topo: Topology) -> Plan:
    shape = model_shape(topo)
    gpu = gpu_of(topo) if topo.device == "cuda" else None
    roles = [plan_role(topo, role, shape, gpu) for role in topo.server_roles()]
    out = Plan(topo.source, topo.topology, topo.device, gpu.name if gpu else None, shape.source, roles)
    try:
        out.window, out.limits = topo.admission_plan()
    except ValueError as e:
        out.window_error = str(e)
    return out


def check(topo: Topology, require_memory: bool = True) -> Plan:
    """The launcher's gate: ValueError naming what fits when a CUDA role's kv_tokens cannot be
    allocated (or, with `require_memory`, cannot be checked)."""
    p = plan(topo)
    bad = [r for r in p.roles if r.verdict == "REFUSED" or (require_memory and r.verdict == "UNCHECKED")]
    if bad:
        raise ValueError(
            "\n".join(f"[{r.role}] {r.verdict}: {r.why}" + "".join(f"\n  fix: {f}" for f in r.fixes) for r in bad)
            + "\n(python -m glm53_serving.plan --config FILE prints the whole plan)"
        )
    return p


# --- output --------------------------------------------------------------------------------------


def _gb(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def render(p: Plan) -> str:
    head = f"{p.source} ({p.topology}, {p.device}{', ' + p.gpu if p.gpu else ''}); model: {p.model}"
    rows = [("role", "GPUs", "KV dtype", "KV B/token", "(latent+index)", "weights/GPU", "pool", "kv_tokens", "verdict")]
    for r in p.roles:
        rows.append(
            (
                r.role,
                f"{r.servers}x{r.gpus or '-'}",
                r.kv_dtype,
                f"{r.cell.total:,}",
                f"{r.cell.latent:,}+{r.cell.index:,}" + (f"+{r.cell.draft:,} draft" if r.cell.draft else ""),
                _gb(r.weights_per_gpu),
                "-" if r.capacity is None else f"{r.capacity:,}",
                f"{r.kv_tokens:,}",
                r.verdict,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [head, *("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)]
    for r in p.roles:
        if r.capacity is not None:
            rest = f"; {r.attn_dp} attention-DP ranks: {r.attn_dp * r.capacity:,} a server" if r.attn_dp > 1 else ""
            lines.append(
                f"  {r.role}: ({_gb(r.gpu_bytes)} a GPU - {_gb(CUDA_CONTEXT_NCCL_BYTES)} CUDA/NCCL) x {r.fraction} "
                f"- {_gb(r.weights_per_gpu)} weights = {r.capacity:,} tokens a rank{rest}"
            )
        if r.why:
            lines.append(f"  {r.role}: {r.why}")
        lines += [f"    fix: {f}" for f in r.fixes]
    if p.window_error:
        lines.append(f"  window: REFUSED: {p.window_error}")
    elif p.limits is not None:
        lines.append(
            f"  window: {p.window:,} advertised; prompts up to {p.limits.max_prompt_tokens:,} tokens, "
            f"prompt + output up to {p.limits.max_model_len:,}"
        )
    lines.append("  verdict: " + ("OK" if p.ok else "REFUSED"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm53_serving.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=None, help=f"topology file; default {default_config_path()}")
    ap.add_argument("--topology", choices=("single", "pd"), default=None, help="override the file's topology")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    try:
        p = plan(Topology.load(args.config or default_config_path(), args.topology))
    except (OSError, ValueError) as e:
        print(f"bad topology: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p.to_json(), indent=2) if args.json else render(p))
    return 0 if p.ok else 2


if __name__ == "__main__":
    sys.exit(main())

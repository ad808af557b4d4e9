"""What SGLang 0.5.23 needs to run on a CPU-only machine (measured; docs/upstream.md).

Applied by the launcher when a topology says `device = "cpu"`, never otherwise. The one
in-process override (Mooncake's host-index send path) is a row of hooks.HOOKS with cpu_only=True.
"""

from __future__ import annotations

# Environment for every SGLang process of a CPU topology.
ENV = {
    # sglang.srt.utils.is_cpu() requires it; without it rotary_embedding imports
    # vllm._custom_ops (a CUDA extension) even with --device cpu.
    "SGLANG_USE_CPU_ENGINE": "1",
    # On a radix-cache hit prefill records torch.cuda.Event() on its forward stream
    # (disaggregation/prefill.py maybe_send_cached_prefix_chunk); the early send is only an
    # overlap optimisation, so CPU turns it off.
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
}

# Flags for every SGLang server of a CPU topology.
SERVER_ARGS = (
    "--device",
    "cpu",
    # intel_amx needs the real sgl_kernel CPU build; torch_native is plain SDPA.
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    # graph capture is a CUDA-graph feature.
    "--cuda-graph-backend-decode",
    "disabled",
    "--cuda-graph-backend-prefill",
    "disabled",
)

# Decode's default retraction backup is a HiCache host pool registered with cudaHostRegister
# (mem_cache/pool_host/common.py _cuda_host_register); cpu_tensor keeps it in plain host memory.
DECODE_ARGS = ("--disaggregation-decode-retraction-backup", "cpu_tensor")

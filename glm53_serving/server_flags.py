"""Every SGLang flag that adds a process, a cache tier or a KV allocation path: covered by our
guards, or refused at start-up.

Invariant: a server starts only in configurations where every process that serves requests runs
the plugin's guards, every KV page a request can read came through an allocation we zero and tag,
and every cache tier that brings pages back does so through those same paths. A flag that adds
one of those and is not known to be covered is refused (fail closed), with the reason.

Attack/configuration closed: `--tokenizer-worker-num > 1` starts extra HTTP worker processes that
import SGLang's app by path and never call `load_plugins()` (http_server.py: no call on that path;
engine.py, scheduler.py, detokenizer_manager.py and data_parallel_controller.py have one), so they
would serve without validation, tenant guard or length limit while the handshake of the first
process passed. HiCache loads pages back from host memory or storage into pages that carry no
owner tag: every host-cache hit would fail as an isolation violation, or, with the owner part off,
be read unchecked.

`problems(server_args)` runs in every scheduler and in the HTTP process (startup.py);
tests/unit/test_server_flags.py walks the table and holds it against the pinned ServerArgs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger("glm53_serving")


def _on(value: Any) -> bool:
    return bool(value) and value not in ("null", "none", "disabled")


@dataclass(frozen=True, slots=True)
class Flag:
    attr: str  # the ServerArgs attribute (the flag is --attr-with-dashes)
    adds: Literal["process", "cache tier", "allocation path"]
    covered: bool
    why: str
    enabled: Callable[[Any], bool] = _on  # when the value switches the feature on

    @property
    def flag(self) -> str:
        return "--" + self.attr.replace("_", "-")


FLAGS: tuple[Flag, ...] = (
    # --- processes ------------------------------------------------------------------------
    Flag(
        "tokenizer_worker_num",
        "process",
        False,
        "its extra HTTP worker processes never load plugins: they would serve without validation, "
        "tenant guard or length limit",
        lambda v: (v or 1) > 1,
    ),
    Flag("use_ray", "process", False, "Ray scheduler actors do not load plugins"),
    Flag(
        "grpc_mode",
        "process",
        False,
        "the gRPC server has none of the HTTP front door (validation, tenant guard, hard 4xx)",
    ),
    Flag("smg_grpc_mode", "process", False, "the gRPC server has none of the HTTP front door"),
    Flag("enable_pdmux", "process", False, "PD multiplexing runs prefill and decode in one scheduler: not reviewed"),
    Flag(
        "nnodes",
        "process",
        False,
        "a server spanning nodes: the schedulers of the other nodes report to no HTTP process of ours "
        "(not reviewed; the production layouts run each server on one node)",
        lambda v: (v or 1) > 1,
    ),
    Flag("decoupled_spec_role", "process", False, "decoupled speculative decoding: draft workers not reviewed"),
    Flag(
        "dp_size",
        "process",
        True,
        "each data-parallel scheduler loads plugins and runs the start-up check; the HTTP process "
        "requires every scheduler's stamp (read in the code, not run on CPU)",
        lambda v: (v or 1) > 1,
    ),
    Flag(
        "attn_dp_size", "process", True, "as dp_size: every attention-DP scheduler is checked", lambda v: (v or 1) > 1
    ),
    Flag("pp_size", "process", True, "every pipeline stage's scheduler is checked", lambda v: (v or 1) > 1),
    Flag(
        "detokenizer_worker_num",
        "process",
        True,
        "detokenizers admit nothing and hold no KV: they turn token ids into text",
        lambda v: (v or 1) > 1,
    ),
    # --- cache tiers ----------------------------------------------------------------------
    Flag(
        "enable_hierarchical_cache",
        "cache tier",
        False,
        "HiCache loads pages back from host memory or storage without owner tags",
    ),
    Flag("hicache_storage_backend", "cache tier", False, "a HiCache storage tier (pages loaded back untagged)"),
    Flag("enable_lmcache", "cache tier", False, "LMCache stores and loads KV outside the allocator we guard"),
    Flag(
        "disaggregation_decode_enable_offload_kvcache",
        "cache tier",
        False,
        "decode offloads KV to host or storage and loads it back untagged",
    ),
    Flag("enable_unified_cache_external_linker", "cache tier", False, "an external KV store: not reviewed"),
    Flag("enable_session_radix_cache", "cache tier", False, "session-scoped radix caches: not reviewed"),
    Flag(
        "disaggregation_decode_enable_radix_cache",
        "cache tier",
        False,
        "a prefix cache on PD decode (pre-allocation over shared pages): not reviewed",
    ),
    # --- allocation paths -------------------------------------------------------------------
    Flag("speculative_algorithm", "allocation path", False, "alloc_for_spec_decode sets no owner tags"),
    Flag("enable_hisparse", "allocation path", False, "HiSparse keeps its own host KV tier and device buffers"),
    Flag("enable_memory_saver", "allocation path", False, "releasing and resuming KV memory: not reviewed"),
    Flag("enable_kv_cache_sharding", "allocation path", False, "sharded KV pools: not reviewed"),
    Flag("enable_dsa_cache_layer_split", "allocation path", False, "DSA pools split by layer: not reviewed"),
    Flag(
        "disaggregation_transfer_backend",
        "allocation path",
        False,
        "the fake backend transfers nothing: decode would decode over pre-allocated pages no prefill wrote",
        lambda v: v == "fake",
    ),
    Flag(
        "enable_mixed_chunk",
        "allocation path",
        True,
        "mixed batches allocate through alloc_for_extend (tagged, checked)",
    ),
)


class Refused(RuntimeError):
    pass


def refuse(server_args, where: str) -> None:
    """Raise (the server exits) when `server_args` sets a flag the guards do not cover. Called by
    the HTTP process before it starts anything: some of these crash or load weights first."""
    found = problems(server_args)
    if found:
        msg = f"glm53_serving: refusing to start ({where}): " + "; ".join(found)
        logger.error(msg)
        raise Refused(msg)


def problems(server_args) -> list[str]:
    """One line per flag set on `server_args` that the guards do not cover (empty: none)."""
    out = []
    for f in FLAGS:
        if not f.covered and f.enabled(getattr(server_args, f.attr, None)):
            out.append(f"{f.flag} {getattr(server_args, f.attr)!r} is refused: {f.why}")
    return out

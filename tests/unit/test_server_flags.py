"""The table of SGLang flags that add a process, a cache tier or a KV allocation path
(server_flags.FLAGS), walked row by row and held against the pinned ServerArgs."""

import re

import msgspec
import pytest
from sglang.srt.server_args import ServerArgs

from glm53_serving import server_flags
from glm53_serving.server_flags import FLAGS

DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(ServerArgs)}
ON = {bool: True, int: 2, str: "on", type(None): "on"}
ON_VALUE = {"disaggregation_transfer_backend": "fake"}  # rows switched on by one value of a string


def on(attr):
    return ON_VALUE.get(attr, ON[type(DEFAULTS[attr])])


# Names that say a flag adds a process, a cache tier or an allocation path. Every ServerArgs field
# they match is in FLAGS, or below with why it needs no row of its own: a flag added upstream is
# reviewed before it is served.
REVIEW = re.compile(
    r"worker_num|use_ray|grpc_mode|pdmux|nnodes|dp_size|pp_size|hierarchical|hicache|lmcache|offload_kvcache|"
    r"external_linker|radix_cache|speculative_algorithm|hisparse|memory_saver|kv_cache_sharding|cache_layer_split|"
    r"mixed_chunk|decoupled_spec_role|transfer_backend"
)
NO_ROW = {
    "encoder_transfer_backend": "the multimodal encoder's transfer backend: text-only model (validation refuses media)",
    "mm_processor_worker_num": "multimodal preprocessing threads: text-only model (validation refuses media)",
    "mm_io_worker_num": "multimodal I/O threads: text-only model",
    "grpc_worker_threads": "threads of the gRPC server, which is refused (grpc_mode)",
    "moe_dp_size": "MoE expert data parallelism inside one scheduler's forward: no process, no KV",
    "dwdp_size": "weight-streaming data parallelism inside the forward: no process, no KV",
    "disable_radix_cache": "turns a cache off",
    "radix_cache_backend": "the radix tree's implementation; its pages come from the guarded allocator",
    "mamba_radix_cache_strategy": "Mamba state caches: not a GLM-5.3 layer type (kv_zero refuses other pools)",
    "uses_mamba_radix_cache": "derived, Mamba only",
    "hicache_ratio": "a HiCache setting; HiCache itself is refused",
    "hicache_size": "a HiCache setting",
    "hicache_write_policy": "a HiCache setting",
    "hicache_io_backend": "a HiCache setting",
    "hicache_mem_layout": "a HiCache setting",
    "hicache_host_memory_fraction": "a HiCache setting",
    "hicache_host_memory_mode": "a HiCache setting",
    "hicache_storage_prefetch_policy": "a HiCache setting",
    "hicache_storage_prefetch_retry_max_attempts": "a HiCache setting",
    "hicache_storage_prefetch_retry_poll_interval": "a HiCache setting",
    "hicache_storage_backend_extra_config": "a HiCache setting",
    "hisparse_config": "a HiSparse setting; HiSparse itself is refused",
    "pdmux_config_path": "a PD-multiplexing setting; PD multiplexing itself is refused",
    "lmcache_config_file": "an LMCache setting; LMCache itself is refused",
    "unified_cache_external_linker_backend": "a setting of the refused external linker",
    "unified_cache_external_linker_config": "a setting of the refused external linker",
}


def test_every_row_names_a_real_flag_and_its_default_is_served():
    for f in FLAGS:
        assert f.attr in DEFAULTS, f"{f.attr}: not a ServerArgs field of the pinned SGLang"
        assert not f.enabled(DEFAULTS[f.attr]), f"{f.attr}: its default would switch the feature on"
    assert server_flags.problems(_Args(DEFAULTS)) == []


class _Args:
    def __init__(self, values):
        self.__dict__.update(values)


@pytest.mark.parametrize("row", [f for f in FLAGS if not f.covered], ids=lambda f: f.attr)
def test_each_refused_flag_is_refused_with_its_reason(row):
    value = on(row.attr)
    (problem,) = server_flags.problems(_Args({**DEFAULTS, row.attr: value}))
    assert row.flag in problem and row.why in problem


@pytest.mark.parametrize("row", [f for f in FLAGS if f.covered], ids=lambda f: f.attr)
def test_each_covered_flag_starts(row):
    assert server_flags.problems(_Args({**DEFAULTS, row.attr: on(row.attr)})) == []


def test_every_flag_that_adds_a_process_a_cache_tier_or_an_allocation_path_was_reviewed():
    rows = {f.attr for f in FLAGS}
    unreviewed = sorted(n for n in DEFAULTS if REVIEW.search(n) and n not in rows and n not in NO_ROW)
    assert not unreviewed, f"add these to server_flags.FLAGS (covered or refused) or to NO_ROW with why: {unreviewed}"
    assert not {n for n in NO_ROW if n not in DEFAULTS}, "NO_ROW names fields the pinned SGLang does not have"


def test_the_architecture_doc_lists_every_row_with_its_verdict():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    listed = dict(re.findall(r"^\| `(--[a-z-]+)` \| [a-z ]+ \| (covered|refused) \|", doc, re.M))
    assert listed == {f.flag: "covered" if f.covered else "refused" for f in FLAGS}

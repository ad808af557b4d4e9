"""The CPU compat sgl_kernel: PyTorch ops match the semantics of the kernels they stand in for."""

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sgl_kernel


def test_it_is_the_compat_package_not_the_real_one():
    assert sgl_kernel.IS_GLM53_CPU_COMPAT


@st.composite
def assign_case(draw):
    pool_rows, pool_len = draw(st.integers(2, 8)), draw(st.integers(1, 32))
    bs = draw(st.integers(0, pool_rows))
    rows = draw(st.permutations(range(pool_rows)))[:bs]
    spans = []
    for _ in range(bs):
        a = draw(st.integers(0, pool_len))
        b = draw(st.integers(a, pool_len))
        spans.append((a, b))
    return pool_rows, pool_len, rows, spans


@settings(max_examples=200, deadline=None)
@given(assign_case())
def test_assign_req_to_token_pool_matches_reference(case):
    pool_rows, pool_len, rows, spans = case
    total = sum(b - a for a, b in spans)
    out_cache_loc = torch.randint(1, 10_000, (total + 3,), dtype=torch.int64)  # slack: kernel reads a prefix
    got = torch.full((pool_rows, pool_len), -1, dtype=torch.int32)
    want = got.clone()
    off = 0
    for r, (a, b) in zip(rows, spans):  # the Triton kernel's semantics, one request at a time
        want[r, a:b] = out_cache_loc[off : off + b - a].to(torch.int32)
        off += b - a
    sgl_kernel.assign_req_to_token_pool_cpu(
        torch.tensor(rows, dtype=torch.int64),
        got,
        torch.tensor([a for a, _ in spans], dtype=torch.int64),
        torch.tensor([b for _, b in spans], dtype=torch.int64),
        out_cache_loc,
        pool_len,
    )
    assert torch.equal(got, want)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16), st.data())
def test_copy_all_layer_kv_cache_reads_all_sources_before_writing(rows, data):
    bufs = [torch.randn(rows, 3), torch.randint(0, 255, (rows, 5), dtype=torch.uint8)]
    n = data.draw(st.integers(0, rows))
    tgt = data.draw(st.permutations(range(rows)))[:n]  # distinct targets, sources may overlap them
    src = data.draw(st.lists(st.integers(0, rows - 1), min_size=n, max_size=n))
    want = [b.clone() for b in bufs]
    for w in want:
        w[tgt] = w[src].clone()
    sgl_kernel.copy_all_layer_kv_cache_cpu(
        torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64),
        torch.tensor(tgt, dtype=torch.int64),
        torch.tensor(src, dtype=torch.int64),
    )
    for b, w in zip(bufs, want):
        assert torch.equal(b, w)


@pytest.mark.parametrize(
    "name", [n for n in sgl_kernel.__all__ if n not in ("assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu")]
)
def test_ops_off_our_path_raise_not_implemented_naming_the_op(name):
    with pytest.raises(NotImplementedError, match=name):
        getattr(sgl_kernel, name)()


def test_unknown_names_stay_import_errors_so_sglang_fallbacks_still_work():
    with pytest.raises(ImportError):
        exec("from sgl_kernel import merge_state_v2", {})
    assert not hasattr(sgl_kernel, "silu_and_mul")


def test_sglang_imports_exactly_what_the_compat_package_provides():
    # The modules that import sgl_kernel CPU ops at import time under SGLANG_USE_CPU_ENGINE=1.
    for mod in (
        "sglang.srt.mem_cache.allocation",
        "sglang.kernels.ops.kvcache.cache_move",
        "sglang.kernels.ops.speculative.eagle",
        "sglang.kernels.ops.speculative.cache_locs",
        "sglang.kernels.ops.speculative.spec_tree",
    ):
        importlib.import_module(mod)

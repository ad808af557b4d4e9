"""The pure parts of the GLM-5.x DSA CPU path (glm53_serving/cpu_dsa.py): fp8 index-key
quantisation, SGLang's index-K page layout, top-k selection; and its rows are CPU-only."""

import pytest
import torch

from glm53_serving import cpu_dsa, hooks

PAGE, DIM = 64, 128


def test_quantize_is_fp8_with_a_power_of_two_scale_per_row():
    torch.manual_seed(0)
    k = torch.randn(5, DIM) * torch.tensor([0.01, 1.0, 3.0, 100.0, 0.0])[:, None]
    q, s = cpu_dsa.quantize_index_k(k)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (5,)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # ue8m0: a power of two
    amax = k.abs().amax(-1).clamp_min(1e-4)
    assert bool(((amax / s) <= cpu_dsa.FP8_MAX).all()) and bool(((amax / s) > cpu_dsa.FP8_MAX / 2).all())
    deq = q.float() * s[:, None]
    assert torch.allclose(deq, k, rtol=0.07, atol=1e-6)


def test_index_k_layout_is_sglangs():
    # mem_cache/index_key_cache.py, kernels/ops/kvcache/dsa_index_k_cache.py: per page row,
    # 64 x 128 fp8 bytes then 64 fp32 scales.
    buf = torch.zeros(3, PAGE * (DIM + 4), dtype=torch.uint8)
    torch.manual_seed(1)
    q, s = cpu_dsa.quantize_index_k(torch.randn(2, DIM))
    loc = torch.tensor([5, 64 + 63])
    cpu_dsa.write_index_k(buf, loc, q, s, PAGE)
    assert torch.equal(buf[0, 5 * DIM : 6 * DIM], q[0].view(torch.uint8))
    assert torch.equal(buf[0, PAGE * DIM + 5 * 4 : PAGE * DIM + 6 * 4].view(torch.float32), s[:1])
    assert torch.equal(buf[1, 63 * DIM : 64 * DIM], q[1].view(torch.uint8))
    assert torch.equal(buf[1, PAGE * DIM + 63 * 4 :].view(torch.float32), s[1:])
    assert int(buf.count_nonzero()) == int(q.view(torch.uint8).count_nonzero()) + int(
        s.view(torch.uint8).count_nonzero()
    )  # nothing else written
    assert torch.equal(cpu_dsa.read_index_k(buf, loc, DIM, PAGE), q.float() * s[:, None])


def test_select_is_causal_topk_padded_with_minus_one_and_ties_go_to_earlier_positions():
    scores = torch.tensor([[3.0, 9.0, 1.0, 5.0], [0.0, 0.0, 0.0, 2.0], [4.0, 1.0, 0.0, 0.0]])
    out = cpu_dsa._select(scores, torch.tensor([1, 3, 3]), topk=3)
    assert out.dtype == torch.int32
    assert out.tolist() == [[1, 0, -1], [3, 0, 1], [0, 1, 2]]
    wide = cpu_dsa._select(scores, torch.tensor([3, 3, 3]), topk=6)  # fewer keys than topk
    assert wide.shape == (3, 6) and wide[:, 4:].eq(-1).all()


@pytest.mark.parametrize("row", [h for h in hooks.HOOKS if h.impl and h.impl.startswith("glm53_serving.cpu_dsa:")])
def test_dsa_rows_are_cpu_only_platform_fixes(row):
    assert row.cpu_only and not row.guard
    assert row not in hooks.active_hooks(cpu=False, guards=True)
    assert row.dsa_only and row not in hooks.active_hooks(cpu=True, guards=True)  # glm53-tiny imports none of it
    assert row in hooks.active_hooks(cpu=True, guards=True, dsa=True)


def test_decode_retraction_backs_a_dsa_request_up_to_host_memory_and_back_on_cpu():
    """SGLang's own get_cpu_copy / load_cpu_copy of the DSA pool (latent and index-K pages), with
    the row applied by HookRegistry: upstream raises at torch.cuda.synchronize() on CPU."""

    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", device="cpu", attention_backend="torch_native")
    with runtime_context.use_context(runtime_context.create_context(args, role="scheduler")):
        _round_trip()


def _round_trip():
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    from tests.unit.real_hooks import applied
    from tests.unit.test_kv_zero import make

    pool, _ = make(PAGE, dsa=True)
    pool.cpu_offloading_chunk_size = 8192
    torch.manual_seed(2)
    for buf in (*pool.kv_buffer, *pool.index_key_cache.buffer):
        buf.copy_(torch.randint(1, 100, buf.shape).to(buf.dtype))
    pages = torch.arange(PAGE, 3 * PAGE)  # the request's two pages (slots 64..191)
    with pytest.raises((AssertionError, RuntimeError), match="NVIDIA driver"):  # upstream, without the row
        pool.get_cpu_copy(pages)
    rows = tuple(h for h in hooks.HOOKS if h.impl == "glm53_serving.cpu_dsa:host_copy_without_cuda_sync")
    assert {h.target.rsplit(".", 1)[1] for h in rows} == {"get_cpu_copy", "load_cpu_copy"}
    with applied(rows):
        saved = pool.get_cpu_copy(pages)
        before = [b.clone() for b in (*pool.kv_buffer, *pool.index_key_cache.buffer)]
        for buf in (*pool.kv_buffer, *pool.index_key_cache.buffer):
            buf.zero_()  # the pages go to other requests while this one waits
        pool.load_cpu_copy(saved, pages)
        after = [*pool.kv_buffer, *pool.index_key_cache.buffer]
        for b, a in zip(before[:3], after[:3]):  # latent rows of the request's slots
            assert torch.equal(a[pages], b[pages]) and a[:PAGE].count_nonzero() == 0
        for b, a in zip(before[3:], after[3:]):  # index-K rows of its pages
            assert torch.equal(a[1:3], b[1:3]) and a[0].count_nonzero() == 0
    assert isinstance(pool, DSATokenToKVPool)

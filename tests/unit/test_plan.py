"""The capacity planner against SGLang 0.5.23 itself: the KV bytes per token its real pools
allocate (built on CPU), its own cell-size and pool-sizing functions (called without a GPU), the
incident's configurations refused with what fits, and every shipped layout planned."""

import argparse
import types

import pytest
import torch

from glm53_serving import launch, plan
from glm53_serving.models import dsa_tiny, tiny
from glm53_serving.topology import REPO_LAUNCH_DIR, Topology

GLM53 = plan.Shape(dict(plan.GLM53_CONFIG), "GLM-5.3")
PAGE = 64
H200_PD = """
topology = "pd"
device = "cuda"
gpu = "H200"
[model]
path = "/nonexistent/GLM-5.3"
context_length = {ctx}
[worker]
page_size = 64
args = ["--tp-size", "8", "--mem-fraction-static", "0.85"{extra}]
[prefill]
kv_tokens = {prefill}
[decode]
kv_tokens = {decode}
"""


def write(tmp_path, ctx, prefill, decode, extra=""):
    p = tmp_path / "t.toml"
    p.write_text(H200_PD.format(ctx=ctx, prefill=prefill, decode=decode, extra=extra))
    return p


# --- the incident -------------------------------------------------------------------------------


def test_the_incidents_million_token_window_over_a_681280_token_prefill_pool_is_refused_saying_what_fits(
    tmp_path, capsys
):
    p = write(tmp_path, 1_048_576, 681_280, 4_000_000)
    result = plan.plan(Topology.load(p))
    assert not result.ok
    # The window over the smaller pool: admission_plan's own refusal, with the clamp that fits.
    assert "exceeds the prefill role's KV capacity (681280 tokens)" in result.window_error
    assert "the window becomes 681280" in result.window_error
    # And 681,280 tokens of bf16 KV do not fit 8xH200 TP8 either: the pool SGLang would allocate.
    prefill = result.roles[0]
    assert (prefill.verdict, prefill.kv_dtype, prefill.capacity) == ("REFUSED", "bfloat16", 295_872)
    assert prefill.fixes[0].startswith("kv_tokens = 295,872 fits (window 295,872, prompts up to ")
    assert "--kv-cache-dtype fp8_e4m3: 61,464 B/token, 482,112 tokens" in prefill.fixes[1]
    assert plan.main(["--config", str(p)]) == 2
    out = capsys.readouterr().out
    assert "window: REFUSED" in out and "kv_tokens 681,280 > the 295,872 tokens SGLang can allocate" in out


def test_a_million_token_pool_on_8xh200_with_bf16_kv_is_refused_by_the_launcher_before_anything_starts(
    tmp_path, capsys
):
    p = write(tmp_path, 1_048_576, 1_048_576, 1_048_576)
    run_dir = tmp_path / "run"
    assert launch.main(["--config", str(p), "--run-dir", str(run_dir)]) == 2
    out = capsys.readouterr()
    said = out.out + out.err
    assert "[prefill] REFUSED: kv_tokens 1,048,576 > the 295,872 tokens SGLang can allocate" in said
    assert "fix: kv_tokens = 295,872 fits (window 295,872" in said
    # fp8 alone (482,112) is not enough; twice the GPUs with fp8 KV is, and the planner says a
    # 16-GPU server spans nodes, which server_flags refuses.
    assert "482,112 tokens (not enough alone)" in said
    assert "--tp-size 16 (16 GPUs a server) with fp8 KV: 1,238,528 tokens (more than one 8-GPU node" in said
    assert not run_dir.exists()  # refused before the run directory or any process
    with pytest.raises(ValueError, match=r"\[decode\] REFUSED"):
        plan.check(Topology.load(p))


def test_a_cuda_topology_without_gpu_memory_is_unchecked_and_the_launcher_refuses_to_start_it(tmp_path, capsys):
    p = write(tmp_path, 4096, 8192, 8192)
    p.write_text(p.read_text().replace('gpu = "H200"\n', ""))
    roles = plan.plan(Topology.load(p)).roles
    assert [r.verdict for r in roles] == ["UNCHECKED", "UNCHECKED"]
    assert launch.main(["--config", str(p), "--run-dir", str(tmp_path / "r")]) == 2
    assert "[prefill] UNCHECKED: no GPU memory: set gpu (H100, H200) or gpu_memory_gib" in capsys.readouterr().err
    assert plan.check(Topology.load(p), require_memory=False).roles[0].verdict == "UNCHECKED"  # dry runs


# --- KV bytes per token: SGLang's real pools ----------------------------------------------------


def sglang_context(**server_args):
    """SGLang's runtime context for a scheduler, without a GPU (as tests/unit/test_cpu_dsa.py)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", device="cpu", attention_backend="torch_native", **server_args)
    return args, runtime_context.use_context(runtime_context.create_context(args, role="scheduler"))


def hf_config(cfg: dict):
    from transformers import GlmMoeDsaConfig

    keep = {k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config", "torch_dtype")}
    hf = GlmMoeDsaConfig(**{k: v for k, v in keep.items() if k in GlmMoeDsaConfig().to_dict()})
    hf.architectures = ["GlmMoeDsaForCausalLM"]
    return hf


def model_config(cfg: dict):
    return types.SimpleNamespace(
        hf_config=hf_config(cfg), kv_lora_rank=cfg["kv_lora_rank"], qk_rope_head_dim=cfg["qk_rope_head_dim"]
    )


def dsa_pool_bytes(cfg: dict, dtype: torch.dtype, pages: int) -> tuple[int, int]:
    """(latent bytes, index-K bytes) of SGLang's DSATokenToKVPool for `pages` pages, built as
    kv_cache_configurator.py:_build_dsa_kv_pool builds it (its kv_cache_dim and skip_topk_layers)."""
    from sglang.srt.configs.model_config import dsa_layer_skips_topk
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    mc = model_config(cfg)
    layers = cfg["num_hidden_layers"]
    _, ctx = sglang_context(dsa_prefill_backend="flashmla_kv", dsa_decode_backend="flashmla_kv")
    with ctx:
        dim = calculate_mla_kv_cache_dim(model_config=mc, kv_cache_dtype=dtype)
    pool = DSATokenToKVPool(
        size=pages * PAGE,
        page_size=PAGE,
        kv_lora_rank=cfg["kv_lora_rank"],
        dtype=dtype,
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        layer_num=layers,
        device="cpu",
        index_head_dim=cfg["index_head_dim"],
        enable_memory_saver=False,
        kv_cache_dim=dim,
        index_buf_size=pages * PAGE,  # SGLang's default with one DCP rank (memory_pool.py DSATokenToKVPool)
        skip_topk_layers=[dsa_layer_skips_topk(mc.hf_config, i) for i in range(layers)],
    )
    return sum(b.nbytes for b in pool.kv_buffer), sum(b.nbytes for b in pool.index_key_cache.buffer)


def per_token(cfg, dtype, torch_dtype) -> tuple[int, int]:
    """What one more token costs in SGLang's real pool: the difference between 4 and 2 pages
    (each pool also holds one padding page and slot, which the difference cancels)."""
    big, small = dsa_pool_bytes(cfg, torch_dtype, 4), dsa_pool_bytes(cfg, torch_dtype, 2)
    return (big[0] - small[0]) // (2 * PAGE), (big[1] - small[1]) // (2 * PAGE)


SHARED = {**plan.GLM53_CONFIG, "indexer_types": ["full", "shared", "shared", "full"] * 19 + ["full", "full"]}


@pytest.mark.parametrize(
    "cfg, dtype, torch_dtype, expected",
    [
        (plan.GLM53_CONFIG, "bfloat16", torch.bfloat16, (78 * 576 * 2, 78 * 132)),  # 100,152 B
        (plan.GLM53_CONFIG, "fp8", torch.float8_e4m3fn, (78 * 656, 78 * 132)),  # 61,464 B: packed fp8 row
        (SHARED, "fp8", torch.float8_e4m3fn, (78 * 656, 40 * 132)),  # shared-top-k layers: no index-K rows
        (dsa_tiny.CONFIG, "float32", torch.float32, (3 * 48 * 4, 3 * 132)),  # glm53-tiny as served on CPU
    ],
    ids=["glm53-bf16", "glm53-fp8", "glm53-shared-indexer-fp8", "dsa-tiny-fp32"],
)
def test_kv_bytes_per_token_equal_what_sglangs_dsa_pool_allocates(cfg, dtype, torch_dtype, expected):
    latent, index = per_token(cfg, dtype, torch_dtype)
    cell = plan.kv_cell(plan.Shape(dict(cfg), "test"), dtype)
    assert (cell.latent, cell.index) == (latent, index) == expected


def test_kv_bytes_per_token_of_glm53_tiny_equal_sglangs_mha_pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    def nbytes(size):
        pool = MHATokenToKVPool(size, 1, torch.float32, 2, 16, 2, "cpu", False)
        return sum(b.nbytes for b in (*pool.k_buffer, *pool.v_buffer))

    cell = plan.kv_cell(plan.Shape(dict(tiny.CONFIG), "glm53-tiny"), "float32")
    assert cell.total == (nbytes(256) - nbytes(128)) // 128 == 2 * 2 * (16 + 16) * 4


# --- SGLang's own sizing functions ----------------------------------------------------------------


def sglang_cell_size(cfg: dict, torch_dtype, **server_args) -> int:
    """DefaultPoolConfigurator._compute_cell_size (pool_configurator.py:340) on a stand-in for the
    KVCacheConfigurator it is a method of (a real one needs a loaded model on a GPU): the fields
    the MLA/DSA branch reads, and nothing else."""
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    args, ctx = sglang_context(**server_args)
    layers = cfg["num_hidden_layers"]
    kvc = types.SimpleNamespace(
        model_config=model_config(cfg),
        kv_cache_dtype=torch_dtype,
        use_mla_backend=True,
        server_args=args,
        is_draft_worker=False,
        layer_info=types.SimpleNamespace(start_layer=0, end_layer=layers, num_effective_layers=layers),
        mambaish_config=None,
    )
    configurator = object.__new__(DefaultPoolConfigurator)
    configurator.kv_cache_dtype_str = "auto"
    with ctx:
        return configurator._compute_cell_size(kvc, layers)


@pytest.mark.parametrize(
    "flag_dtype, torch_dtype, backends, expected",
    [
        ("bfloat16", torch.bfloat16, ("flashmla_sparse", "fa3"), 100_152),  # H200 bf16 defaults
        ("fp8_e4m3", torch.float8_e4m3fn, ("flashmla_kv", "flashmla_kv"), 61_464),  # H200 fp8 defaults
        ("fp8_e4m3", torch.float8_e4m3fn, ("tilelang", "tilelang"), 78 * (576 + 132)),  # raw fp8 rows
    ],
    ids=["bf16", "fp8-packed", "fp8-raw-tilelang"],
)
def test_the_planners_cell_size_is_sglangs_own_for_glm53(tmp_path, flag_dtype, torch_dtype, backends, expected):
    p = write(
        tmp_path,
        4096,
        8192,
        8192,
        f', "--kv-cache-dtype", "{flag_dtype}", "--dsa-prefill-backend", "{backends[0]}", '
        f'"--dsa-decode-backend", "{backends[1]}"',
    )
    role = plan.plan(Topology.load(p)).roles[1]  # decode
    sglang = sglang_cell_size(
        plan.GLM53_CONFIG, torch_dtype, dsa_prefill_backend=backends[0], dsa_decode_backend=backends[1]
    )
    assert role.cell.total == sglang == expected


def test_the_pool_size_is_sglangs_own_profile_and_sizing_for_glm53_on_h200(monkeypatch):
    """SGLang's _profile_available_bytes (kv_cache_configurator.py:2990) and calculate_pool_sizes
    (pool_configurator.py:637), fed the memory the planner assumes: free memory before the weights
    (total - the CUDA/NCCL margin) and after them. Stand-ins: the GPU memory query, the
    configurator's attributes, and the CUDA-graph settings a CPU context leaves unset."""
    from sglang.srt.mem_cache import kv_cache_configurator as kvc_mod
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.runtime_context import get_parallel

    topo = Topology.load(REPO_LAUNCH_DIR / "glm53-h200-pd.toml")
    role = plan.plan(topo).roles[1]
    pre = role.gpu_bytes - plan.CUDA_CONTEXT_NCCL_BYTES
    monkeypatch.setattr(kvc_mod, "get_available_gpu_memory", lambda *a, **k: (pre - role.weights_per_gpu) / plan.GiB)
    graphs = types.SimpleNamespace(prefill=types.SimpleNamespace(full_prefill_max_req=None, backend=None))
    monkeypatch.setattr(
        kvc_mod, "get_exec", lambda: types.SimpleNamespace(graph=types.SimpleNamespace(cuda_graph_config=graphs))
    )
    _, ctx = sglang_context(mem_fraction_static=role.fraction)
    me = types.SimpleNamespace(
        device="cuda", gpu_id=0, mambaish_config=None, model_config=types.SimpleNamespace(is_multimodal=False)
    )
    with ctx, get_parallel().override(world_group=types.SimpleNamespace(cpu_group=None)):
        available = kvc_mod.KVCacheConfigurator._profile_available_bytes(me, pre / plan.GiB)
    configurator = object.__new__(DefaultPoolConfigurator)
    configurator._fixed_overhead_bytes, configurator._cell_size = 0, role.cell.total
    assert configurator.calculate_pool_sizes(available, PAGE).max_total_num_tokens == role.capacity == 482_112


# --- shipped layouts ----------------------------------------------------------------------------

PRODUCTION = ["glm53-h200-pd.toml", "glm53-h200-single.toml"]


@pytest.mark.parametrize("path", sorted(REPO_LAUNCH_DIR.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_passes_the_planner_or_states_its_window(path, capsys):
    assert plan.main(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    topo = Topology.load(path)
    window, _ = topo.admission_plan()
    assert f"window: {window:,} advertised" in out and "verdict: OK" in out
    if topo.device == "cpu":
        assert "the GPU memory check is skipped" in out
    else:
        for role in plan.plan(topo).roles:
            assert role.verdict == "OK" and role.capacity >= role.kv_tokens >= window
            assert role.kv_dtype == "fp8" and role.cell.total == 61_464


def sglang_parser():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


@pytest.mark.parametrize("name", PRODUCTION)
def test_every_production_server_command_parses_with_sglangs_server_args(name, tmp_path):
    """SGLang's own parser and ServerArgs.from_cli_args take every server command line as written.
    (Not resolve_once(): it reads the checkpoint and the GPU's compute capability.)"""
    from sglang.srt.server_args import ServerArgs

    topo = Topology.load(REPO_LAUNCH_DIR / name)
    launched = launch.plan(topo, "/models/GLM-5.3", tmp_path, launch.Tenancy.prepare(topo, tmp_path, create=False))
    servers = [c for c in launched.on(None) if "sglang.launch_server" in c.argv]
    assert len(servers) == len(topo.server_roles())
    for c in servers:
        argv = c.argv[c.argv.index("sglang.launch_server") + 1 :]
        args = ServerArgs.from_cli_args(sglang_parser().parse_args(argv))
        assert (args.kv_cache_dtype, args.tp_size, args.mem_fraction_static) == ("fp8_e4m3", 8, 0.85)
        assert (args.dsa_prefill_backend, args.dsa_decode_backend, args.dsa_topk_backend) == (
            "flashmla_kv",
            "flashmla_kv",
            "sgl-kernel",
        )
        assert (args.tool_call_parser, args.reasoning_parser) == ("glm47", "glm45")
        assert args.enable_metrics and args.watchdog_timeout == 600
        assert (args.max_total_tokens, args.page_size, args.context_length) == (450_048, 64, 202_752)
        if args.disaggregation_mode != "null":
            assert args.disaggregation_ib_device == ",".join(f"mlx5_{i}" for i in range(8))


def test_the_pd_layouts_dry_run_prints_stable_per_node_commands(tmp_path, capsys):
    def dry(node):
        assert launch.main(["--config", str(REPO_LAUNCH_DIR / "glm53-h200-pd.toml"), "--dry-run", "--node", node,
                            "--run-dir", str(tmp_path / "run")]) == 0  # fmt: skip
        return capsys.readouterr().out

    out = {node: dry(node) for node in ("prefill-0", "decode-0", "front")}
    assert out == {node: dry(node) for node in out}  # fixed ports and GPUs: the same commands every time
    assert out["prefill-0"].count("sglang.launch_server") == 1 and "--disaggregation-mode prefill" in out["prefill-0"]
    assert "--host 10.0.0.11 --port 30000" in out["prefill-0"] and "# router" not in out["prefill-0"]
    assert "--disaggregation-mode decode" in out["decode-0"] and "--host 10.0.0.12" in out["decode-0"]
    assert "--max-total-tokens 450048" in out["decode-0"] and "--base-gpu-id 0" in out["decode-0"]
    assert "sglang.launch_server" not in out["front"] and "--host 0.0.0.0 --port 8080" in out["front"]
    assert "--prefill http://10.0.0.11:30000 8998 --decode http://10.0.0.12:30000" in out["front"]


@pytest.mark.parametrize("preset", [tiny, dsa_tiny], ids=["glm53-gqa-tiny", "glm53-tiny"])
def test_the_weights_counted_from_the_shape_are_the_bytes_of_the_generated_checkpoint(preset):
    """Every tensor of the presets' real checkpoints (MLA, indexer, dense and MoE layers, router,
    embeddings) is counted once with its dtype: the file's bytes, to the byte (fp32, unquantized)."""
    import math

    from safetensors import safe_open

    path = preset.ensure()
    on_disk = 0
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            on_disk += sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())
    total, per_gpu = plan.weight_bytes(plan.Shape(dict(preset.CONFIG), preset.__name__))
    assert total == per_gpu == on_disk


def test_glm53_weights_per_gpu_on_tp8():
    """GLM-5.3 FP8 (128x128 block scales; embeddings, norms, router in bf16): ~744 B parameters,
    ~95 GB a GPU at TP8 (the fused q_a/kv_a projections and the indexer are replicated)."""
    total, per_gpu = plan.weight_bytes(GLM53, tp=8, attn_tp=8)
    assert 745e9 < total < 770e9 and 94e9 < per_gpu < 97e9
    _, dp8 = plan.weight_bytes(GLM53, tp=8, attn_tp=1)  # attention DP 8: every GPU holds all of attention
    assert dp8 - per_gpu > 10e9


def test_a_checkpoint_on_disk_is_read_its_config_and_its_index_total_size(tmp_path, capsys):
    """[model] path on this machine: its config.json is the shape and the safetensors index's
    metadata.total_size the weights (split over the GPUs as the shape says)."""
    import json

    ckpt = tmp_path / "GLM-5.3"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**plan.GLM53_CONFIG, "num_hidden_layers": 78}))
    computed, per_gpu = plan.weight_bytes(GLM53, tp=8, attn_tp=8)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": computed + 8 * 10**9}}))
    p = write(tmp_path, 202_752, 450_048, 450_048, ', "--kv-cache-dtype", "fp8_e4m3"')
    p.write_text(p.read_text().replace("/nonexistent/GLM-5.3", str(ckpt)))
    result = plan.plan(Topology.load(p))
    assert result.model == str(ckpt / "config.json")
    role = result.roles[0]
    assert role.weights_per_gpu == per_gpu * (computed + 8 * 10**9) // computed > per_gpu + 10**9
    assert role.capacity < 482_112  # 1 GB more weights a GPU: ~16K fewer tokens
    assert plan.main(["--config", str(p), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and [r["kv_bytes_per_token"] for r in out["roles"]] == [61_464, 61_464]
    assert out["limits"]["max_input_tokens"] == 202_624 and out["window"] == 202_752


def test_attention_dp_keeps_the_per_rank_pool_bound_and_replicates_attention_weights(tmp_path, capsys):
    plain = plan.plan(Topology.load(write(tmp_path, 202_752, 450_048, 450_048, ', "--kv-cache-dtype", "fp8_e4m3"')))
    dp = write(tmp_path, 202_752, 450_048, 450_048, ', "--kv-cache-dtype", "fp8_e4m3", "--attn-dp-size", "8"')
    with_dp = plan.plan(Topology.load(dp))
    a, b = plain.roles[1], with_dp.roles[1]
    assert a.cell == b.cell  # the latent is one head: the same row on every GPU either way
    assert b.weights_per_gpu - a.weights_per_gpu > 10**10 and b.capacity < a.capacity
    assert plan.main(["--config", str(dp)]) == 2  # 450,048 no longer fits one rank
    out = capsys.readouterr().out
    assert f"8 attention-DP ranks: {8 * b.capacity:,} a server" in out
    assert f"kv_tokens 450,048 > the {b.capacity:,} tokens SGLang can allocate" in out

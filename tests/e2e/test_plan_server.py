"""The capacity planner against a real server: the KV pool glm53-tiny's single server
allocates (SGLang's own sglang:kv_cache_memory_usage_gb, the bytes of every latent and index-K
buffer) is the planner's KV bytes per token times the pool's tokens, plus SGLang's padding."""

import httpx
import pytest

from glm53_serving import plan
from glm53_serving.topology import REPO_LAUNCH_DIR, Topology
from tests.e2e.launcher import alive, launch

pytestmark = pytest.mark.e2e


def gauge(metrics: str, name: str) -> float:
    values = {float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name)}
    assert len(values) == 1, (name, values)
    return values.pop()


def test_the_dsa_servers_kv_pool_is_the_planners_bytes_per_token(tmp_path):
    config = REPO_LAUNCH_DIR / "cpu.toml"
    role = plan.plan(Topology.load(config, "single")).roles[0]
    run = launch(tmp_path / "run", "--config", str(config), "--topology", "single")
    try:
        metrics = httpx.get(f"{run.worker('server')}/metrics", timeout=30).text
    finally:
        run.stop()
    assert not alive(run.info["all_pids"])
    tokens = int(gauge(metrics, "sglang:max_total_num_tokens"))
    allocated = round(gauge(metrics, "sglang:kv_cache_memory_usage_gb") * plan.GiB)
    page = 64
    # The latent buffers hold one padding page more (memory_pool.py MLATokenToKVPool._create_buffers),
    # the index-K buffers (tokens + page + 1) // page pages (index_key_cache.py IndexKeyCache).
    index_pages = (tokens + page + 1) // page
    assert tokens == role.kv_tokens == 2048
    assert allocated == (tokens + page) * role.cell.latent + index_pages * page * role.cell.index
    assert role.cell.total == 972  # 3 layers x (48 fp32 latent = 192 B + 132 B of index-K)

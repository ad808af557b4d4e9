"""GLM53_BATCH_INVARIANT=1: a row's matmul result does not depend on the batch it came in.

Each case runs in a fresh interpreter (the kernels are replaced process-wide, through SGLang's
real plugin loader where the switch is read)."""

import pytest

from tests.unit.test_plugin_loading import run_probe

CHECK = r"""
import json, torch
import torch.nn.functional as F
from sglang.srt.plugins import load_plugins
load_plugins()
from glm53_serving import batch_invariant, plugin
g = torch.Generator().manual_seed(1)
x, w = torch.randn(70, 64, generator=g), torch.randn(640, 64, generator=g)
whole = F.linear(x, w)
alone = torch.stack([F.linear(x[i : i + 1], w)[0] for i in range(70)])
a, b = torch.randn(4, 70, 16, generator=g), torch.randn(4, 16, 40, generator=g)
bmm_whole = torch.bmm(a, b)
bmm_alone = torch.cat([torch.bmm(a[:, i : i + 1], b) for i in range(70)], dim=1)
print("RESULT" + json.dumps({
    "problems": plugin._problems, "status": plugin.status(),
    "linear_equal": torch.equal(whole, alone), "bmm_equal": torch.equal(bmm_whole, bmm_alone),
    "linear_close": torch.allclose(whole, alone, atol=1e-5), "bmm_close": torch.allclose(bmm_whole, bmm_alone, atol=1e-5),
}))
"""

SABOTAGED = r"""
import json, torch
from glm53_serving import batch_invariant
batch_invariant.enable(cpu=True)
clean = batch_invariant.violations()
real = batch_invariant._mm_into
def leaky(a, b, out):  # a result that moves with the batch's size, as MKL's blocking does
    real(a, b, out)
    out.add_(a.shape[0] * 1e-6)
batch_invariant._mm_into = leaky
print("RESULT" + json.dumps({"clean": clean, "sabotaged": batch_invariant.violations()}))
"""


def test_with_the_switch_every_row_comes_out_the_same_alone_and_in_a_batch_of_70():
    res, _ = run_probe(CHECK, GLM53_BATCH_INVARIANT="1")
    assert res["problems"] == [] and res["status"]["batch_invariant"] is True, res
    assert res["linear_equal"] and res["bmm_equal"], res
    assert res["linear_close"] and res["bmm_close"], res  # and the same numbers, not just the same bits


def test_without_the_switch_nothing_is_replaced():
    res, _ = run_probe(CHECK)
    assert res["problems"] == [] and res["status"]["batch_invariant"] is False, res


def test_the_start_up_check_catches_a_kernel_whose_rows_move_with_the_batch():
    res, _ = run_probe(SABOTAGED)
    assert res["clean"] == []
    assert res["sabotaged"] and all("batch invariance" in v for v in res["sabotaged"]), res


@pytest.mark.parametrize("value", ["true", "2"])
def test_an_ambiguous_value_fails_closed(value):
    res, _ = run_probe(CHECK, GLM53_BATCH_INVARIANT=value)
    assert any("GLM53_BATCH_INVARIANT" in p for p in res["problems"]), res


def test_on_a_gpu_platform_the_switch_refuses_and_names_sglangs_own():
    res, _ = run_probe(CHECK, cpu=False, GLM53_BATCH_INVARIANT="1")
    assert any("--enable-deterministic-inference" in p for p in res["problems"]), res
    assert res["status"]["batch_invariant"] is False

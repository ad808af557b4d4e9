"""The plugin loads through SGLang's real entry-point loader and verifies itself in that process.

Each case runs in a fresh interpreter: SGLang's load_plugins() and HookRegistry are per-process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SABOTAGE = str(Path(__file__).resolve().parents[1] / "support" / "sabotage")

PROBE = r"""
import json
from sglang.srt.plugins import load_plugins
load_plugins()
from glm53_serving import plugin
print("RESULT" + json.dumps({"problems": plugin.problems("http"), "status": plugin.status()}))
"""


# A scheduler process as on a GPU: SGLang resolves the platform from SGLANG_USE_CPU_ENGINE
# (utils.is_cpu), so without it the table resolves as on CUDA; the probe then enters the real
# (hooked) Scheduler.__init__, whose rows run before upstream's body fails on no arguments, and
# runs the scheduler's own start-up self-check.
CUDA_SCHEDULER_PROBE = r"""
import json
from sglang.srt.plugins import load_plugins
from sglang.srt.utils import is_cpu
load_plugins()
from glm53_serving import plugin
from sglang.srt.managers.scheduler import Scheduler
try:
    Scheduler(None, None)
except Exception:
    pass
print("RESULT" + json.dumps({"is_cpu": is_cpu(), "problems": plugin.problems("scheduler"),
                             "status": plugin.status()}))
"""


def run_probe(probe=PROBE, cpu=True, **env):
    drop = ("GLM53_SERVING_DISABLE", "GLM53_KV_GUARD_OFF", "GLM53_CPU_DSA", "SGLANG_USE_CPU_ENGINE")
    e = {k: v for k, v in os.environ.items() if k not in drop}
    if cpu:
        e["SGLANG_USE_CPU_ENGINE"] = "1"
    e.update(**env)
    out = subprocess.run([sys.executable, "-c", probe], env=e, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :]), out.stderr


def test_entry_point_registers_and_every_hook_applies():
    res, _ = run_probe(GLM53_CPU_DSA="1")  # a DSA model on CPU: every row of the table
    assert res["problems"] == []
    assert res["status"]["active"] is True
    from glm53_serving.hooks import HOOKS

    assert set(res["status"]["hooks"]) == {h.target for h in HOOKS}  # CPU: cpu_only rows included


def test_the_dsa_rows_apply_only_where_a_dsa_model_is_served():
    res, _ = run_probe()
    from glm53_serving.hooks import HOOKS, active_hooks

    assert res["problems"] == [] and set(res["status"]["hooks"]) == {
        h.target for h in active_hooks(cpu=True, guards=True)
    }
    assert {h.target for h in HOOKS if h.dsa_only} & set(res["status"]["hooks"]) == set()


def test_on_a_gpu_platform_a_scheduler_passes_its_self_check_with_every_row_but_the_cpu_ones():
    """GPU readiness without a GPU: a row a scheduler needs everywhere but registered only on CPU
    (as the Mooncake reason row once was) leaves a CUDA scheduler refusing to start."""
    from glm53_serving.hooks import HOOKS, active_hooks

    res, _ = run_probe(CUDA_SCHEDULER_PROBE, cpu=False, GLM53_CPU_DSA="1")
    assert res["is_cpu"] is False  # the probe really resolved the table as on a GPU
    assert res["problems"] == [], res["problems"]
    assert set(res["status"]["hooks"]) == {h.target for h in active_hooks(cpu=False, guards=True)}
    assert {h.target for h in HOOKS if not h.cpu_only} <= set(res["status"]["hooks"])
    assert not {h.target for h in HOOKS if h.cpu_only} & set(res["status"]["hooks"])


def test_a_hook_that_fails_to_apply_is_listed_among_the_problems_the_handshake_refuses_on():
    """That a real server then refuses to start: tests/e2e/test_launcher.py
    (test_missing_hook_stops_the_server_from_starting), per hook-installing target."""
    target = "sglang.srt.managers.scheduler.Scheduler.get_init_info"
    res, _ = run_probe(PYTHONPATH=SABOTAGE, GLM53_TEST_BREAK_HOOK=target)
    assert any(target in p and "not applied" in p for p in res["problems"]), res


def test_explicit_disable_is_reported_not_hidden():
    res, err = run_probe(GLM53_SERVING_DISABLE="1")
    assert res["problems"] == []
    assert res["status"]["active"] is False and res["status"]["disabled_by"] == "GLM53_SERVING_DISABLE=1"
    assert "guards are DISABLED" in err


@pytest.mark.parametrize("value", ["true", "yes", "2"])
def test_ambiguous_disable_value_fails_closed(value):
    res, _ = run_probe(GLM53_SERVING_DISABLE=value)
    assert any("GLM53_SERVING_DISABLE" in p for p in res["problems"]), res


def test_switching_kv_guard_parts_off_is_explicit_announced_and_drops_only_their_rows():
    from glm53_serving.hooks import active_hooks

    res, err = run_probe(GLM53_KV_GUARD_OFF="owner,handoff")
    assert res["problems"] == []
    st = res["status"]
    assert st["active"] is True and st["kv_guard"] == {"zero": True, "owner": False, "handoff": False}
    assert st["kv_guard_off_by"] == "GLM53_KV_GUARD_OFF=owner,handoff"
    assert set(st["hooks"]) == {
        h.target for h in active_hooks(cpu=True, guards=True) if h.part not in ("owner", "handoff")
    }
    assert "KV guard parts switched OFF" in err


def test_an_unknown_kv_guard_part_fails_closed():
    res, _ = run_probe(GLM53_KV_GUARD_OFF="zeroing")
    assert any("GLM53_KV_GUARD_OFF" in p and "zeroing" in p for p in res["problems"]), res

"""scripts/gpu-check cannot run here (no GPU), but its checks can: rehearsed on the CPU, its hook
check resolves the table as on CUDA, and its KV guard check uses SGLang's real DSA pool on the
CPU. So the script a GPU owner runs is known to work up to the device, and its guard check
can fail."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"


def rehearse(**env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--rehearse-on-cpu"],
        env={**e, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out.returncode, out.stdout


def test_gpu_check_rehearsed_on_cpu_passes_its_hook_and_kv_guard_checks():
    rc, out = rehearse()
    assert rc == 0, out
    assert "PASS  hooks" in out and "problems: none" in out
    assert "PASS  kv guard  latent zero True, index-K zero True, others untouched True, tags True" in out
    assert out.strip().splitlines()[-1].startswith("gpu-check: 2/2 passed")


def test_gpu_check_fails_when_the_kv_guard_is_off():
    rc, out = rehearse(GLM53_KV_GUARD_OFF="1")
    assert rc == 1, out
    assert "FAIL  kv guard  latent zero False, index-K zero False" in out

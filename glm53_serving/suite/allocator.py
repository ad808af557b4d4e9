"""The allocator state machines, run by the suite: the unit suite's Hypothesis machines over
SGLang's real allocators and pools with the plugin's hooks applied (tests/unit/test_kv_zero.py:
zero before reuse, page size 1, 4 and the DSA pool; tests/unit/test_kv_owner.py: owner tags and
the read check over real batch builds), scaled by the profile, their steps counted."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from glm53_serving.suite.oracles import Finding

REPO = Path(__file__).resolve().parents[2]
MACHINES = ("tests/unit/test_kv_zero.py", "tests/unit/test_kv_owner.py")
SELECT = "TestZeroBeforeReuse or TestOwnerTags"


def run(scale: float, timeout_s: float) -> tuple[int, list[Finding]]:
    """(steps run, findings): a machine that fails is a finding of the "allocator" oracle."""
    with tempfile.TemporaryDirectory() as tmp:
        steps_file = Path(tmp) / "steps"
        env = {**os.environ, "GLM53_SUITE_STEPS_FILE": str(steps_file), "GLM53_SUITE_STEP_SCALE": str(scale)}
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SELECT, *MACHINES]
        p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        lines = steps_file.read_text().split("\n") if steps_file.exists() else []
    steps = sum(int(line.split()[1]) for line in lines if line.strip())
    found = []
    if p.returncode != 0:
        found.append(Finding("allocator", None, f"the allocator state machines failed:\n{p.stdout[-3000:]}"))
    return steps, found

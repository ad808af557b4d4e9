"""The checks engineers run on themselves, held by CI: lint, format, and the layers of the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_lint_is_clean():
    out = run(str(BIN / "ruff"), "check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_code_is_formatted():
    out = run(str(BIN / "ruff"), "format", "--no-cache", "--check", ".")
    assert out.returncode == 0, "run `.venv/bin/ruff format .`:\n" + out.stdout[-4000:]


def test_the_import_contracts_hold():
    """pyproject.toml [tool.importlinter]: the gateway and the deployment side import nothing that
    runs inside SGLang, worker guards import no gateway or deployment code, no import circles."""
    out = run(str(BIN / "lint-imports"), "--no-cache")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_the_import_contracts_can_fail(tmp_path):
    """A gateway module importing a worker guard breaks a contract (the check is not vacuous)."""
    probe = ROOT / "glm53_serving" / "gateway" / "_contract_probe.py"
    probe.write_text("from glm53_serving import kv_owner  # noqa: F401\n")
    try:
        out = run(str(BIN / "lint-imports"), "--no-cache")
    finally:
        probe.unlink()
    assert out.returncode != 0 and "BROKEN" in out.stdout, out.stdout[-2000:]

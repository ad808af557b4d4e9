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

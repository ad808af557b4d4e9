"""Every upstream patch under patches/ applies cleanly to the pinned release and still compiles."""

import py_compile
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import sglang

PATCHES = sorted((Path(__file__).resolve().parents[2] / "patches").glob("*.patch"))
SITE = Path(sglang.__file__).resolve().parent.parent


def test_there_are_patches():
    assert PATCHES


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_applies_to_pinned_sglang(patch, tmp_path):
    text = patch.read_text()
    assert text.split("\n", 1)[0].startswith("What:"), "each patch starts with a What/Why header"
    files = re.findall(r"^\+\+\+ b/(\S+)", text, flags=re.M)
    assert files
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SITE / f, tmp_path / f)
    out = subprocess.run(
        ["patch", "-p1", "--forward", "--no-backup-if-mismatch", "-d", str(tmp_path)],
        input=text,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "offset" not in out.stdout and "fuzz" not in out.stdout, out.stdout  # cleanly, not approximately
    for f in files:
        py_compile.compile(str(tmp_path / f), doraise=True)

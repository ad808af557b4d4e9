"""The repository stands alone: every relative link in README.md and docs/ resolves inside it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_relative_link_resolves_inside_the_repository():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path = (doc.parent / target).resolve()
            if not path.exists() or ROOT not in path.parents and path != ROOT:
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_no_document_points_outside_the_repository():
    outside = [
        f"{p.relative_to(ROOT)}"
        for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "glm53_serving").rglob("*.py")]
        if "../shared" in p.read_text() or "shared/research" in p.read_text()
    ]
    assert not outside, outside

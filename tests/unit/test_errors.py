"""The error contract: docs/errors.md and errors.CONTRACT are the same list, and every body is the shape."""

import re
from pathlib import Path

import pytest

from glm53_serving.errors import CONTRACT, ClientError

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


def documented() -> dict[str, tuple[int, str]]:
    rows = re.findall(r"^\| `([a-z_]+)` \| (\d{3}) \| ([a-z_]+) \|", DOC.read_text(), re.M)
    return {code: (int(status), kind) for code, status, kind in rows}


def test_the_documented_contract_is_the_code_contract():
    assert documented() == CONTRACT


@pytest.mark.parametrize("code", sorted(CONTRACT))
def test_every_code_builds_the_openai_shape(code):
    body = ClientError(code, "m", param="p", details={"n": 1}).body()
    assert body == {"error": {"message": "m", "type": CONTRACT[code][1], "param": "p", "code": code, "n": 1}}


def test_a_code_outside_the_contract_cannot_be_built():
    with pytest.raises(TypeError):
        ClientError("made_up", "m")

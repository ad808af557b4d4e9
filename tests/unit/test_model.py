"""The GLM-5.3 model definition (glm53_serving/model.py): SGLang resolves GlmMoeDsaForCausalLM to
it, and it refuses a checkpoint of another shape, naming the field, before any weight is read."""

import json

import pytest
from transformers import AutoConfig

from glm53_serving import hooks, model
from glm53_serving.models import dsa_tiny
from tests.unit.real_hooks import applied

# GLM-5.3-Flash: another architecture under a GLM-5 name (glm5_next, research note)
FLASH = {
    **model.SHAPE,
    "model_type": "glm5_next",
    "hidden_size": 4096,
    "num_hidden_layers": 45,
    "n_routed_experts": 288,
}


def test_glm53s_own_shape_and_the_shipped_preset_pass():
    assert model.config_problems(dict(model.SHAPE)) == []
    assert model.config_problems(AutoConfig.from_pretrained(dsa_tiny.ensure())) == []


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (FLASH, ["model_type is 'glm5_next'", "hidden_size is 4096", "num_hidden_layers is 45"]),
        ({**model.SHAPE, "index_head_dim": 64}, ["index_head_dim is 64"]),
        ({k: v for k, v in model.SHAPE.items() if k != "index_topk"}, ["index_topk is missing"]),
        ({**model.SHAPE, "index_topk": None}, ["index_topk is missing"]),  # DSA off: not GLM-5.3
        ({**dsa_tiny.CONFIG, "kv_lora_rank": 64}, ["kv_lora_rank is 64"]),  # a preset edited by hand
        ({**dsa_tiny.CONFIG, "glm53_preset": "glm53-huge"}, ["glm53_preset 'glm53-huge' is not a preset"]),
        ({**dsa_tiny.CONFIG, "index_head_dim": 64}, ["index_head_dim is 64"]),
    ],
)
def test_another_shape_is_refused_naming_the_field(config, named):
    problems = model.config_problems(config)
    for text in named:
        assert any(p.startswith(text) for p in problems), problems
    with pytest.raises(model.ModelShapeError, match="not GLM-5.3"):
        model.check_config(config)


def test_sglang_resolves_glm5_to_our_class_which_refuses_before_building_anything(tmp_path):
    from sglang.srt.models.glm4_moe import GlmMoeDsaForCausalLM as Upstream
    from sglang.srt.models.registry import ModelRegistry

    row = next(h for h in hooks.HOOKS if h.impl == "glm53_serving.model:resolve_model_hook")
    with applied((row,)):
        cls, arch = ModelRegistry.resolve_model_cls(["GlmMoeDsaForCausalLM"])
        assert arch == "GlmMoeDsaForCausalLM" and cls.__name__ == arch and issubclass(cls, Upstream)
        assert cls is model.model_class()
        other, _ = ModelRegistry.resolve_model_cls(["Glm4MoeForCausalLM"])  # as upstream
        assert other.__module__ == "sglang.srt.models.glm4_moe"
        ckpt = tmp_path / "edited"
        ckpt.mkdir()
        cfg = json.loads((dsa_tiny.ensure() / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({**cfg, "glm53_preset": None, "index_head_dim": 64}))
        with pytest.raises(model.ModelShapeError, match="index_head_dim is 64"):
            cls(AutoConfig.from_pretrained(ckpt))  # raised before any layer exists

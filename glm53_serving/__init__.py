"""glm53_serving: GLM-5.3 on SGLang, prefill/decode disaggregated, with tenant isolation that fails closed.

The SGLang plugin entry point is `glm53_serving.plugin:register`; the table of everything we
hook is `glm53_serving.hooks.HOOKS`; `python -m glm53_serving.launch` starts a topology.
"""

__version__ = "0.1.0"

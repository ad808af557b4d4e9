"""glm53-tiny: the embedded default model, generated locally and deterministically.

A random-weight checkpoint in Hugging Face layout with GLM-5.3's MoE block family (sigmoid-gated
routed experts with a correction bias, one shared expert, first layer dense) and attention that
runs on CPU (GQA, `Glm4MoeForCausalLM`; GLM-5.3's MLA+DSA needs CUDA). Nothing is downloaded:
the tokenizer is a byte-level BPE trained here on a fixed corpus, the weights come from a fixed
seed. The checkpoint is cached outside the repository and regenerated when missing or when this
recipe changes (the cache directory is named by the recipe's hash).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from glm53_serving import env

SEED = 20260814  # GLM-5.3's launch date
RECIPE_VERSION = 1
# Special tokens in GLM's chat format; id 0 is end-of-text so that pad/eos are the same token.
SPECIAL_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
EOS = "<|endoftext|>"
VOCAB_SIZE = 512

CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "partial_rotary_factor": 0.5,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "use_qk_norm": False,
    "hidden_act": "silu",
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": None,
    "eos_token_id": 0,
    "pad_token_id": 0,
}

# GLM's chat format: [gMASK]<sop> then role-tagged turns, generation opens an assistant turn.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>\n{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<|user|>\n{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}"
    "{% else %}<|observation|>\n{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. Hello world, hello tenant, hello decode server.
def main():\n    print("hello")\n    return 0\nclass Request:\n    def __init__(self, rid):\n        self.rid = rid
Prefill and decode run on separate servers; the KV cache travels between them over the network.
A request that is too long must be rejected with an error, never answered with someone else's data.
import torch\nfor i in range(10):\n    x = torch.zeros(4, 4)\n    y = x @ x.T\n
{"role": "user", "content": "Write a function that sorts a list."} [1, 2, 3] (a, b) <tag> </tag>
0123456789 +-*/=<>!?.,;:'"`~@#$%^&|\\ \t\n
"""


def recipe_hash() -> str:
    blob = json.dumps(
        {
            "v": RECIPE_VERSION,
            "seed": SEED,
            "config": CONFIG,
            "tpl": CHAT_TEMPLATE,
            "corpus": _CORPUS,
            "special": SPECIAL_TOKENS,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cache_root() -> Path:
    base = env.CACHE_DIR.get() or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "glm53_serving"
    )
    return Path(base)


def default_path() -> Path:
    return cache_root() / "models" / f"glm53-tiny-{recipe_hash()}"


def ensure(path: Path | None = None) -> Path:
    """Return the checkpoint directory, generating it first if it is missing."""
    path = Path(path) if path else default_path()
    if (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent reader never sees half a checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        generate(tmp)
        try:
            tmp.rename(path)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def generate(out: Path) -> None:
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)

    torch.manual_seed(SEED)
    cfg = Glm4MoeConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    cfg.architectures = CONFIG["architectures"]
    model = Glm4MoeForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        # A non-zero routing bias, so the correction-bias path is exercised, not skipped.
        for layer in model.model.layers[cfg.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    (out / "glm53_tiny.json").write_text(json.dumps({"recipe": recipe_hash(), "seed": SEED}) + "\n")


if __name__ == "__main__":
    print(ensure())

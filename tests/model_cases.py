"""The one table of tiny model cases, shared by model tests and engine tests.

Usage: ``from tests.model_cases import MODEL_CASES, build_checkpoint`` and, for a session-wide
cache of checkpoint dirs, import the ``checkpoint_factory`` fixture into the test module.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from nebula_engine.model.tiny import make_tiny_checkpoint


@dataclass(frozen=True)
class ModelCase:
    name: str
    family: str
    overrides: dict[str, Any] = field(default_factory=dict)  # HF config fields
    seed: int = 0

    def __str__(self) -> str:
        return self.name


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # the 3 wavelength bands at D=16
MODEL_CASES: tuple[ModelCase, ...] = (
    ModelCase("llama_gqa2", "llama", seed=11),
    ModelCase("llama3_rope_scaling_tied", "llama", dict(tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE), seed=12),
    ModelCase("llama_attention_mlp_bias_mqa", "llama",
              dict(attention_bias=True, mlp_bias=True, num_key_value_heads=1, head_dim=24), seed=13),
    ModelCase("mistral_gqa2", "mistral"),
    ModelCase("mistral_sliding_window6", "mistral", dict(sliding_window=6), seed=7),
    ModelCase("mistral_mqa_hd24_tied", "mistral",
              dict(num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True), seed=1),
    ModelCase("qwen2_gqa2_qkv_bias", "qwen2", seed=16),
    ModelCase("qwen2_mqa_tied_theta1e6", "qwen2",
              dict(num_key_value_heads=1, tie_word_embeddings=True, rope_parameters={"rope_theta": 1e6}), seed=17),
    ModelCase("qwen3_gqa2_hd20", "qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=20), seed=2),
    ModelCase("qwen3_mha_tied_theta1e6", "qwen3",
              dict(num_key_value_heads=4, tie_word_embeddings=True, rope_parameters={"rope_theta": 1e6}), seed=3),
    ModelCase("qwen3_yarn", "qwen3",
              dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                    "original_max_position_embeddings": 1024}), seed=4),
    ModelCase("qwen3_moe_renorm", "qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True), seed=5),
    ModelCase("qwen3_moe_step2_mlp_only_no_renorm", "qwen3_moe",
              dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                   num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2,
                   mlp_only_layers=[3]), seed=6),
)

# MLA latent-cache and hybrid linear-attention families: model tests, and the engine tests in
# tests/engine/test_generate_vs_hf_hybrid.py (latent pages, per-sequence state slots).
_YARN_V2_LITE = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 512,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
HYBRID_AND_MLA_CASES: tuple[ModelCase, ...] = (
    ModelCase("deepseek_v2_lite_greedy_yarn", "deepseek_v2", dict(rope_parameters=_YARN_V2_LITE), seed=7),
    # V2-shaped: q LoRA, group-limited routing, scaled weights, mscale != mscale_all_dim (cos/sin scaled too)
    ModelCase("deepseek_v2_qlora_group_limited", "deepseek_v2",
              dict(num_hidden_layers=3, q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                   num_experts_per_tok=3, routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
                   rope_parameters={**_YARN_V2_LITE, "mscale": 1.0, "mscale_all_dim": 0.8}), seed=8),
    ModelCase("qwen3_5_linear_full_linear", "qwen3_5", seed=9),
    # init 0.1: with 0.15 this 4-layer MoE amplifies fp32 rounding past 1e-4 (each layer matches to 1e-6)
    ModelCase("qwen3_5_moe_full_linear_linear_full_tied", "qwen3_5_moe",
              dict(num_hidden_layers=4, tie_word_embeddings=True, initializer_range=0.1,
                   layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]), seed=10),
)

CASES_BY_NAME = {case.name: case for case in MODEL_CASES + HYBRID_AND_MLA_CASES}


def build_checkpoint(case: ModelCase, root: Path) -> Path:
    """The checkpoint dir for ``case`` under ``root``, written on first use (atomically, via rename)."""
    out = Path(root) / case.name
    if not out.is_dir():
        staging = Path(root) / f".{case.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        make_tiny_checkpoint(case.family, staging, seed=case.seed, **case.overrides)
        staging.rename(out)
    return out


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory) -> Callable[[ModelCase], Path]:
    """Session-wide: ``checkpoint_factory(case)`` builds each case's checkpoint once."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return lambda case: build_checkpoint(case, root)

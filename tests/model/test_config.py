"""ModelConfig.from_hf on v5 and legacy config.json layouts."""

from __future__ import annotations

import json

import pytest

from nebula_engine.model.config import ModelConfig
from nebula_engine.model.registry import get_model_class, supported_model_types

BASE = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
            intermediate_size=128)


def test_v5_rope_parameters_and_explicit_head_dim():
    config = ModelConfig.from_hf({**BASE, "head_dim": 20, "num_key_value_heads": 2,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert (config.head_dim, config.num_key_value_heads) == (20, 2)
    assert config.rope.theta == 1e6 and config.rope.rotary_dim == 20 and config.rope.scaling is None


def test_legacy_rope_theta_scaling_and_defaults():
    config = ModelConfig.from_hf({**BASE, "rope_theta": 5e5, "partial_rotary_factor": 0.25,
                                  "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 2048},
                                  "eos_token_id": [1, 2], "torch_dtype": "bfloat16"})
    assert config.head_dim == 16 and config.num_key_value_heads == 4
    assert config.rope.theta == 5e5 and config.rope.rotary_dim == 4
    assert config.rope.scaling.type == "yarn" and config.rope.scaling.original_max_position_embeddings == 2048
    assert config.eos_token_ids == (1, 2) and config.dtype == "bfloat16"


def test_int_eos_and_moe_fields(tmp_path):
    raw = {**BASE, "model_type": "qwen3_moe", "eos_token_id": 7, "num_local_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": [3],
           "num_hidden_layers": 6}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_hf(tmp_path)
    assert config.eos_token_ids == (7,) and config.num_experts == 8 and config.mlp_only_layers == (3,)
    assert [config.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "model_type", "intermediate_size"])
def test_missing_required_field_is_named(field):
    raw = {k: v for k, v in BASE.items() if k != field}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(raw)


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "longrope", "factor": 2.0}})


def test_registry_lists_supported_types_for_unknown():
    assert {"mistral", "qwen3", "qwen3_moe"} <= set(supported_model_types())
    assert get_model_class("qwen3").__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*mistral.*qwen3"):
        get_model_class("gpt2")


def test_llama_bias_flags_and_llama3_rope_scaling():
    config = ModelConfig.from_hf({**BASE, "model_type": "llama", "attention_bias": True, "mlp_bias": True,
                                  "max_position_embeddings": 131072,
                                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192}})
    assert config.attention_bias and config.mlp_bias
    scaling = config.rope.scaling
    assert (scaling.type, scaling.factor, scaling.original_max_position_embeddings) == ("llama3", 8.0, 8192)
    assert (scaling.low_freq_factor, scaling.high_freq_factor) == (1.0, 4.0)
    assert get_model_class("llama").__name__ == "LlamaForCausalLM"

"""``model_type`` (from config.json) -> model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, str] = {
    "llama": "nebula_engine.model.llama:LlamaForCausalLM",
    "mistral": "nebula_engine.model.mistral:MistralForCausalLM",
    "qwen2": "nebula_engine.model.qwen2:Qwen2ForCausalLM",
    "qwen3": "nebula_engine.model.qwen3:Qwen3ForCausalLM",
    "qwen3_moe": "nebula_engine.model.qwen3_moe:Qwen3MoeForCausalLM",
    "deepseek_v2": "nebula_engine.model.deepseek_v2:DeepseekV2ForCausalLM",
    # the VL wrappers' types too: ModelConfig.from_hf reads their text_config
    "qwen3_5": "nebula_engine.model.qwen3_5:Qwen3_5ForCausalLM",
    "qwen3_5_text": "nebula_engine.model.qwen3_5:Qwen3_5ForCausalLM",
    "qwen3_5_moe": "nebula_engine.model.qwen3_5:Qwen3_5MoeForCausalLM",
    "qwen3_5_moe_text": "nebula_engine.model.qwen3_5:Qwen3_5MoeForCausalLM",
}


def supported_model_types() -> list[str]:
    return sorted(_MODELS)


def get_model_class(model_type: str) -> type[nn.Module]:
    if model_type not in _MODELS:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}")
    module_name, class_name = _MODELS[model_type].split(":")
    return getattr(importlib.import_module(module_name), class_name)

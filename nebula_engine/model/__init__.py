"""Model layer: HF config parsing, shared layers, one file per family, safetensors loader, registry."""

from nebula_engine.model.base import CausalLM
from nebula_engine.model.config import ModelConfig, RopeConfig, RopeScaling
from nebula_engine.model.loader import build_model, load_model
from nebula_engine.model.registry import get_model_class, supported_model_types

__all__ = ["CausalLM", "ModelConfig", "RopeConfig", "RopeScaling", "build_model", "get_model_class", "load_model",
           "supported_model_types"]

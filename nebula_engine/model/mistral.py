"""Mistral (``model_type: mistral``): Llama-style pre-norm decoder, GQA, neox RoPE, SwiGLU."""

from __future__ import annotations

import logging

from torch import nn

from nebula_engine.model.base import CausalLM
from nebula_engine.model.config import ModelConfig
from nebula_engine.model.layers import DecoderLayer, GatedMLP, RopeAttention

logger = logging.getLogger(__name__)


class MistralForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        if config.hf_config.get("sliding_window"):
            logger.warning("sliding_window=%s is not implemented: attention is full, which is exact "
                           "only for contexts up to the window", config.hf_config["sliding_window"])
        super().__init__(config)

    def make_layer(self, layer_idx: int) -> nn.Module:
        c = self.config
        return DecoderLayer(
            RopeAttention(c, attn_layer_idx=layer_idx),
            GatedMLP(c.hidden_size, c.intermediate_size),
            c.hidden_size,
            c.rms_norm_eps,
        )

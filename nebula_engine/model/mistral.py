"""Mistral (``model_type: mistral``): Llama-style pre-norm decoder, GQA, neox RoPE, SwiGLU, optional sliding window."""

from __future__ import annotations

from torch import nn

from nebula_engine.model.base import CausalLM
from nebula_engine.model.layers import DecoderLayer, GatedMLP, RopeAttention


class MistralForCausalLM(CausalLM):
    def make_layer(self, layer_idx: int) -> nn.Module:
        c = self.config
        return DecoderLayer(
            RopeAttention(c, attn_layer_idx=layer_idx, sliding_window=c.hf_config.get("sliding_window")),
            GatedMLP(c.hidden_size, c.intermediate_size),
            c.hidden_size,
            c.rms_norm_eps,
        )

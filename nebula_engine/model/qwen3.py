"""Qwen3 dense (``model_type: qwen3``): Mistral's layout plus per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from torch import nn

from nebula_engine.model.base import CausalLM
from nebula_engine.model.layers import DecoderLayer, GatedMLP, RopeAttention


class Qwen3ForCausalLM(CausalLM):
    def make_layer(self, layer_idx: int) -> nn.Module:
        c = self.config
        return DecoderLayer(
            RopeAttention(c, attn_layer_idx=layer_idx, qk_norm=True),
            GatedMLP(c.hidden_size, c.intermediate_size),
            c.hidden_size,
            c.rms_norm_eps,
        )

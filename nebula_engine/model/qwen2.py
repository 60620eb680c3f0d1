"""Qwen2 / Qwen2.5 (``model_type: qwen2``): Llama's layout with a bias on q, k and v (none on o), neox RoPE.

Qwen2.5 checkpoints set ``use_sliding_window: false``; a checkpoint that turns the window on (only its
layers from ``max_window_layers`` use it in transformers) is refused rather than run without it.
"""

from __future__ import annotations

from torch import nn

from nebula_engine.model.base import CausalLM
from nebula_engine.model.config import ModelConfig
from nebula_engine.model.layers import DecoderLayer, GatedMLP, RopeAttention


class Qwen2ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        if config.hf_config.get("use_sliding_window"):
            raise ValueError("Qwen2 checkpoints with use_sliding_window: true are not supported")
        super().__init__(config)

    def make_layer(self, layer_idx: int) -> nn.Module:
        c = self.config
        return DecoderLayer(
            RopeAttention(c, attn_layer_idx=layer_idx, qkv_bias=True),
            GatedMLP(c.hidden_size, c.intermediate_size),
            c.hidden_size,
            c.rms_norm_eps,
        )

"""Llama 2 / 3 / 3.1 and SmolLM2 (``model_type: llama``): pre-norm decoder, GQA, neox RoPE, SwiGLU.

Llama 3.1's ``rope_scaling`` (type ``llama3``) lives in the rotary frequencies; ``attention_bias`` puts a
bias on q/k/v/o, ``mlp_bias`` on gate/up/down; small models (SmolLM2, Llama 3.2) tie ``lm_head`` to the
embeddings. ``pretraining_tp`` only split the matmuls during training and changes no output.
"""

from __future__ import annotations

from torch import nn

from nebula_engine.model.base import CausalLM
from nebula_engine.model.layers import DecoderLayer, GatedMLP, RopeAttention


class LlamaForCausalLM(CausalLM):
    def make_layer(self, layer_idx: int) -> nn.Module:
        c = self.config
        return DecoderLayer(
            RopeAttention(c, attn_layer_idx=layer_idx),
            GatedMLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias),
            c.hidden_size,
            c.rms_norm_eps,
        )

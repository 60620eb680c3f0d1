"""Qwen3-MoE (``model_type: qwen3_moe``): Qwen3 attention; MoE on layers chosen by ``is_moe_layer``.

Layer i is sparse iff ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``;
other layers use a dense SwiGLU of width ``intermediate_size``. No shared expert.
"""

from __future__ import annotations

from torch import nn

from nebula_engine.model.base import CausalLM
from nebula_engine.model.layers import DecoderLayer, GatedMLP, RopeAttention, SparseMoE


class Qwen3MoeForCausalLM(CausalLM):
    def make_layer(self, layer_idx: int) -> nn.Module:
        c = self.config
        if c.is_moe_layer(layer_idx):
            mlp = SparseMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                            renormalize=c.norm_topk_prob)
        else:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        return DecoderLayer(RopeAttention(c, attn_layer_idx=layer_idx, qk_norm=True), mlp,
                            c.hidden_size, c.rms_norm_eps)

"""Fused q/k/v projection: the parameters keep their names and stay what the one matmul reads."""

import pytest
import torch

from nebula_engine.kernels.attention import AttentionContext
from nebula_engine.model.config import ModelConfig
from nebula_engine.model.layers import RopeAttention, fuse_linear_weights

CONFIG = ModelConfig.from_hf(dict(model_type="llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=100, intermediate_size=64,
                                  attention_bias=True))


def _reference(attn: RopeAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer computed from q_proj, k_proj and v_proj one by one, as the checkpoint names them."""
    tokens, positions = x.shape[0], torch.arange(x.shape[0])
    q = attn.rotary(positions, attn.q_proj(x).view(tokens, attn.num_heads, attn.head_dim))
    k = attn.rotary(positions, attn.k_proj(x).view(tokens, attn.num_kv_heads, attn.head_dim))
    v = attn.v_proj(x).view(tokens, attn.num_kv_heads, attn.head_dim)
    out = AttentionContext.dense([tokens]).attend(0, q, k, v, attn.scale)
    return attn.o_proj(out.flatten(1))


def _forward(attn: RopeAttention, x: torch.Tensor) -> torch.Tensor:
    return attn(torch.arange(x.shape[0]), x, AttentionContext.dense([x.shape[0]]))


def test_names_are_the_checkpoints_and_loaded_values_reach_the_fused_matmul():
    torch.manual_seed(0)
    attn = RopeAttention(CONFIG, attn_layer_idx=0)
    assert [n for n in attn.state_dict() if "proj" in n] == [
        f"{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")]
    with torch.no_grad():  # what the weight loader does: copy into each named parameter
        for param in attn.parameters():
            param.copy_(torch.randn(param.shape))
    x = torch.randn(5, 32)
    torch.testing.assert_close(_forward(attn, x), _reference(attn, x))


def test_fusion_follows_a_dtype_change():
    torch.manual_seed(1)
    attn = RopeAttention(CONFIG, attn_layer_idx=0).to(torch.float64)  # new storage: the fusion is rebuilt
    with torch.no_grad():
        attn.k_proj.weight.mul_(3)
    x = torch.randn(4, 32, dtype=torch.float64)
    assert attn.qkv_weight.dtype == torch.float64
    torch.testing.assert_close(_forward(attn, x), _reference(attn, x))


def test_projections_with_and_without_bias_are_refused():
    with pytest.raises(ValueError, match="bias"):
        fuse_linear_weights(torch.nn.Linear(4, 2), torch.nn.Linear(4, 3, bias=False))

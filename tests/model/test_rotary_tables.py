"""The flip-and-multiply rotation against the textbook split-halves form: equal bit for bit."""

from __future__ import annotations

import pytest
import torch

from nebula_engine.model.config import ModelConfig, RopeConfig
from nebula_engine.model.llama import LlamaForCausalLM
from nebula_engine.model.rotary import RotaryEmbedding, apply_rotary


def _split_halves_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Each pair (a, b) -> (a cos - b sin, b cos + a sin), the pairs taken apart and put back together."""
    rotary_dim = 2 * cos.shape[-1]
    rot, passthrough = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if style == "neox":
        a, b = rot.chunk(2, dim=-1)
        rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([rotated.to(x.dtype), passthrough], dim=-1)


def _cos_sin(tokens: int, rotary_dim: int, style: str,
             seed: int) -> tuple[RotaryEmbedding, torch.Tensor, torch.Tensor]:
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0, rotary_dim=rotary_dim, style=style))
    positions = torch.randint(0, 32768, (tokens,), generator=torch.Generator().manual_seed(seed))
    return rotary, *rotary.cos_sin(positions)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("tokens,heads,head_dim,rotary_dim", [
    (1, 12, 64, 64), (7, 3, 128, 128), (33, 5, 32, 16), (4, 2, 96, 64), (1, 1, 2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_bit_exact_with_the_split_halves_form(style, tokens, heads, head_dim, rotary_dim, dtype):
    rotary, cos, sin = _cos_sin(tokens, rotary_dim, style, seed=tokens)
    x = torch.randn(tokens, heads, head_dim, generator=torch.Generator().manual_seed(heads)).to(dtype)
    expected = _split_halves_reference(x, cos, sin, style)
    assert torch.equal(apply_rotary(x, cos, sin, style), expected)
    assert torch.equal(rotary.rotate(x, cos, sin), expected)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rotation_of_a_strided_view_and_of_broadcast_cos_sin(style):
    """q/k as column slices of a fused projection; one cos/sin row for every token (a PIC delta)."""
    rotary, cos, sin = _cos_sin(1, 32, style, seed=3)
    qkv = torch.randn(6, 5 * 32)
    x = qkv[:, 32:].view(6, 4, 32)
    assert torch.equal(apply_rotary(x, cos, sin, style), _split_halves_reference(x, cos.expand(6, -1),
                                                                                  sin.expand(6, -1), style))


def test_tables_follow_new_cos_sin():
    """The tables kept for one forward's cos/sin are not reused for the next forward's."""
    rotary, cos, sin = _cos_sin(3, 16, "neox", seed=0)
    x = torch.randn(3, 2, 16)
    first = rotary.rotate(x, cos, sin)
    _, cos2, sin2 = _cos_sin(3, 16, "neox", seed=1)
    assert torch.equal(rotary.rotate(x, cos2, sin2), _split_halves_reference(x, cos2, sin2, "neox"))
    assert not torch.equal(first, rotary.rotate(x, cos2, sin2))


def test_layers_share_one_rotary_embedding_and_keep_their_state_dict():
    config = ModelConfig.from_hf(dict(model_type="llama", hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, intermediate_size=64))
    model = LlamaForCausalLM(config)
    rotaries = {id(layer.self_attn.rotary) for layer in model.model.layers}
    assert len(rotaries) == 1
    assert not any("rotary" in name for name in model.state_dict())

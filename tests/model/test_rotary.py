"""RoPE: both pairings against a complex-number reference; frequencies against transformers."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nebula_engine.model.config import RopeConfig, RopeScaling, parse_rope
from nebula_engine.model.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq


def _complex_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate pairs as complex numbers: x [T, H, D]; only the leading 2*len(inv_freq) dims."""
    rotary_dim = 2 * inv_freq.numel()
    rot = x[..., :rotary_dim].double()
    if style == "neox":
        pairs = torch.stack([rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]], dim=-1)
    else:
        pairs = rot.unflatten(-1, (rotary_dim // 2, 2))
    # angles rounded to fp32 as every fp32 implementation does; the rotation itself in fp64
    angles = (positions.float()[:, None] * inv_freq[None, :]).double()  # [T, r/2]
    phase = torch.polar(torch.ones_like(angles), angles)[:, None]  # [T, 1, r/2]
    rotated = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * phase)
    if style == "neox":
        rotated = torch.cat([rotated[..., 0], rotated[..., 1]], dim=-1)
    else:
        rotated = rotated.flatten(-2)
    return torch.cat([rotated.float(), x[..., rotary_dim:]], dim=-1)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(16, 16), (24, 24), (32, 8), (20, 10)])
def test_rotation_matches_complex_reference(style, head_dim, rotary_dim):
    rope = RopeConfig(theta=10000.0, rotary_dim=rotary_dim, style=style)
    rotary = RotaryEmbedding(rope)
    x = torch.randn(11, 3, head_dim, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 1000, 4095, 3, 3, 9])
    out = rotary(positions, x)
    torch.testing.assert_close(out, _complex_reference(x, positions, rotary.inv_freq, style), atol=2e-5, rtol=1e-5)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])
    assert torch.equal(out[0], x[0])  # position 0 is the identity


def test_neox_and_interleaved_differ_only_by_pair_layout():
    x = torch.randn(5, 2, 16)
    positions = torch.arange(5) * 7
    neox = RotaryEmbedding(RopeConfig(theta=500.0, rotary_dim=16, style="neox"))
    interleaved = RotaryEmbedding(RopeConfig(theta=500.0, rotary_dim=16, style="interleaved"))
    # de-interleave: (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...)
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])
    torch.testing.assert_close(neox(positions, x[..., perm]), interleaved(positions, x)[..., perm])
    assert not torch.allclose(neox(positions, x), interleaved(positions, x))


def test_rotation_composes_for_pic_rerotation():
    """R(p + delta) = R(delta) R(p) with unscaled cos/sin, also for YaRN frequencies."""
    scaling = RopeScaling("yarn", factor=8.0, original_max_position_embeddings=512)
    rotary = RotaryEmbedding(RopeConfig(theta=1e4, rotary_dim=16, scaling=scaling))
    assert rotary.attention_factor > 1
    x = torch.randn(4, 2, 24)
    p, delta = torch.tensor([0, 3, 10, 50]), torch.tensor([5, 5, 100, 7])
    once = apply_rotary(x, *rotary.cos_sin(p + delta, scaled=False), "neox")
    at_p = apply_rotary(x, *rotary.cos_sin(p, scaled=False), "neox")
    twice = apply_rotary(at_p, *rotary.cos_sin(delta, scaled=False), "neox")
    torch.testing.assert_close(once, twice, atol=1e-5, rtol=1e-5)


HF_ROPE_PARAMETERS = [
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 4096,
     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0, "original_max_position_embeddings": 2048,
     "mscale": 1.0, "mscale_all_dim": 0.5, "partial_rotary_factor": 0.5},
    {"rope_type": "yarn", "rope_theta": 5e5, "factor": 2.0, "original_max_position_embeddings": 8192,
     "attention_factor": 1.3, "truncate": False},
    # Llama 3.1 8B's values; then a short original context, so every band (kept, blended, slowed) is hit
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "rope_theta": 1e4, "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 256},
]


@pytest.mark.parametrize("rope_parameters", HF_ROPE_PARAMETERS, ids=lambda p: f"{p['rope_type']}-{p['factor']}")
def test_scaled_inv_freq_matches_transformers(rope_parameters):
    hf_config = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=32, max_position_embeddings=16384,
                            rope_parameters=dict(rope_parameters))
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](hf_config)
    raw = {"max_position_embeddings": 16384, "rope_parameters": dict(rope_parameters)}
    inv_freq, factor = rope_inv_freq(parse_rope(raw, head_dim=32))
    assert inv_freq.dtype == torch.float32
    torch.testing.assert_close(inv_freq, expected_inv_freq, atol=0, rtol=1e-6)
    assert math.isclose(factor, expected_factor, rel_tol=1e-6)


def test_default_inv_freq_is_theta_power():
    inv_freq, factor = rope_inv_freq(RopeConfig(theta=1e6, rotary_dim=8))
    torch.testing.assert_close(inv_freq, torch.tensor([1e6 ** (-i / 8) for i in (0, 2, 4, 6)]))
    assert factor == 1.0


def test_frequencies_stay_fp32_when_the_model_is_cast():
    rotary = RotaryEmbedding(RopeConfig(theta=1e6, rotary_dim=16)).to(torch.bfloat16)
    assert rotary.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rotary.inv_freq, rope_inv_freq(RopeConfig(theta=1e6, rotary_dim=16))[0], atol=0, rtol=0)

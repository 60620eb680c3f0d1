"""Rotary position embedding: frequencies (default, linear, YaRN, Llama 3) and the two pairings.

Legend: T = tokens, H = heads, D = head dim, r = rotary dims (the leading ``r`` of ``D``).
Formulas follow transformers' ``modeling_rope_utils`` so frequencies match it bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from nebula_engine.model.config import RopeConfig, RopeScaling


def rope_inv_freq(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """``inv_freq`` [r/2] in fp32 and the ``attention_factor`` that scales cos/sin (1 unless YaRN)."""
    dim = rope.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    pos_freqs = rope.theta**exponents
    scaling = rope.scaling
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    if scaling.type == "linear":
        return 1.0 / pos_freqs / scaling.factor, 1.0
    if scaling.type == "llama3":
        return _llama3_inv_freq(1.0 / pos_freqs, scaling), 1.0
    if scaling.type == "freq_factors":
        if len(scaling.freq_factors) != dim // 2:
            raise ValueError(f"{len(scaling.freq_factors)} RoPE freq_factors for {dim // 2} frequency pairs")
        return 1.0 / pos_freqs / torch.tensor(scaling.freq_factors, dtype=torch.float32), 1.0
    return _yarn_inv_freq(pos_freqs, rope.theta, dim, scaling), yarn_attention_factor(scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1: wavelengths past ``original / low_freq_factor`` slowed by ``factor``, those under
    ``original / high_freq_factor`` kept, a linear blend in between."""
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > original / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * slowed / scaling.factor + smooth * slowed
    is_medium = (wavelen >= original / scaling.high_freq_factor) & (wavelen <= original / scaling.low_freq_factor)
    return torch.where(is_medium, blended, slowed)


def _yarn_inv_freq(pos_freqs: torch.Tensor, theta: float, dim: int, scaling: RopeScaling) -> torch.Tensor:
    low, high = _yarn_correction_range(theta, dim, scaling)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    interpolated = 1.0 / (scaling.factor * pos_freqs)
    extrapolated = 1.0 / pos_freqs
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def _yarn_correction_range(theta: float, dim: int, scaling: RopeScaling) -> tuple[float, float]:
    """Pair indices where YaRN switches from extrapolation (fast) to interpolation (slow)."""

    def correction_dim(num_rotations: float) -> float:
        wavelength_ratio = scaling.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return dim * math.log(wavelength_ratio) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_attention_factor(scaling: RopeScaling) -> float:
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate the leading ``r = 2 * cos.shape[-1]`` dims of x [T, H, D] by cos/sin [T, r/2]."""
    rotary_dim = 2 * cos.shape[-1]
    rot, passthrough = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, r/2] broadcast over heads
    if style == "neox":
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    if passthrough.shape[-1] == 0:  # every dim rotates: no concatenation (a copy per call)
        return rotated.to(x.dtype)
    return torch.cat([rotated.to(x.dtype), passthrough], dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig):
        super().__init__()
        self.style = rope.style
        inv_freq, self.attention_factor = rope_inv_freq(rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # equal keys give equal cos/sin: layers with the same frequencies share one computation per forward
        self.cache_key = (tuple(inv_freq.tolist()), self.attention_factor)

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) must not round the frequencies: follow device moves, keep fp32
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def cos_sin(self, positions: torch.Tensor, scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, r/2] in fp32; ``scaled=False`` omits the YaRN factor (for PIC re-rotation by Δ)."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        factor = self.attention_factor if scaled else 1.0
        return freqs.cos() * factor, freqs.sin() * factor

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, *self.cos_sin(positions), self.style)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated by cos/sin [T, r/2] of ``cos_sin``."""
        return apply_rotary(x, cos, sin, self.style)

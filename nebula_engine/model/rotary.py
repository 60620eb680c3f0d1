"""Rotary position embedding: frequencies (default, linear, YaRN, Llama 3) and the two pairings.

Legend: T = tokens, H = heads, D = head dim, r = rotary dims (the leading ``r`` of ``D``).
Formulas follow transformers' ``modeling_rope_utils`` so frequencies match it bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from nebula_engine.kernels import cpu_row_ops
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
    """Rotate the leading ``r = 2 * cos.shape[-1]`` dims of x [T, H, D] by cos/sin [T, r/2].

    Each pair (a, b) becomes ``(a cos - b sin, b cos + a sin)``. This is the form for one call with its own
    cos/sin; ``rotate`` computes the same values, bit for bit, faster when the tables are built once for many calls.
    """
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


def rotation_tables(cos: torch.Tensor, sin: torch.Tensor, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, r/2] laid out as ``rotate`` multiplies them: [T, 1, r] each, ``(cos, cos)`` and ``(-sin, sin)``
    per pair (the halves for neox, adjacent values for interleaved)."""
    pair_dim = 1 if style == "neox" else 2
    cos_table = torch.stack((cos, cos), dim=pair_dim).flatten(1)
    sin_table = torch.stack((-sin, sin), dim=pair_dim).flatten(1)
    return cos_table[:, None, :], sin_table[:, None, :]


def rotate(x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, style: str) -> torch.Tensor:
    """``apply_rotary`` by the tables [T, 1, r] of ``rotation_tables``: ``x * cos_table + swapped(x) * sin_table``,
    the two values of each pair swapped by a flip. The same products and sums (``a cos + b (-sin)`` is
    ``a cos - b sin`` exactly) in 4 ops instead of 8."""
    tokens, heads, rotary_dim = x.shape[0], x.shape[1], cos_table.shape[-1]
    rotates_all = rotary_dim == x.shape[-1] and x.dtype == torch.float32
    rot = x if rotates_all else x[..., :rotary_dim].float()
    pairs = (2, rotary_dim // 2) if style == "neox" else (rotary_dim // 2, 2)
    swapped = rot.reshape(tokens, heads, *pairs).flip(2 if style == "neox" else 3).view(tokens, heads, rotary_dim)
    rotated = rot * cos_table + swapped * sin_table
    if rotates_all:
        return rotated
    if rotary_dim == x.shape[-1]:
        return rotated.to(x.dtype)
    return torch.cat([rotated.to(x.dtype), x[..., rotary_dim:]], dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig):
        super().__init__()
        self.style = rope.style
        inv_freq, self.attention_factor = rope_inv_freq(rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # equal keys give equal cos/sin: layers with the same frequencies share one computation per forward
        self.cache_key = (tuple(inv_freq.tolist()), self.attention_factor)
        self._tables: tuple[torch.Tensor, ...] | None = None  # (cos, sin, cos table, sin table) last rotated by

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) must not round the frequencies: follow device moves, keep fp32
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        self._tables = None
        return self

    def cos_sin(self, positions: torch.Tensor, scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, r/2] in fp32; ``scaled=False`` omits the YaRN factor (for PIC re-rotation by Δ)."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        factor = self.attention_factor if scaled else 1.0
        return freqs.cos() * factor, freqs.sin() * factor

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, *self.cos_sin(positions), self.style)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated by cos/sin [T, r/2] of ``cos_sin``.

        The rotation tables are built once for each cos/sin (a forward's, shared by its layers, see
        ``share_rotary_embeddings``), not once per call; holding cos and sin keeps their ids from being reused."""
        tables = self._tables
        if tables is None or tables[0] is not cos or tables[1] is not sin:
            tables = self._tables = (cos, sin, *rotation_tables(cos, sin, self.style))
        return rotate(x, tables[2], tables[3], self.style)

    def rotate_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``rotate``, in place where the CPU op takes x (fp32, each head's dims contiguous; x may be a view of a
        fused projection's output), else into a new tensor: read the result, not x."""
        if cpu_row_ops.usable(x) and x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous():
            cpu_row_ops.rotate_(x, cos, sin, interleaved=self.style == "interleaved")
            return x
        return self.rotate(x, cos, sin)


def share_rotary_embeddings(model: nn.Module) -> None:
    """Make the layers whose rotations are equal (same style and frequencies) hold one ``RotaryEmbedding``: its
    rotation tables are then built once per forward instead of once per layer. It has no parameters or state
    dict entries, so names and loading are unchanged."""
    shared: dict[tuple, RotaryEmbedding] = {}
    owners = [(module, name, child) for module in model.modules() for name, child in module.named_children()
              if isinstance(child, RotaryEmbedding)]
    for module, name, child in owners:
        key = (child.style, child.cache_key, child.inv_freq.device)
        setattr(module, name, shared.setdefault(key, child))

"""Move cached post-RoPE keys from positions p to p + Δ by rotating them by Δ.

RoPE is a rotation per frequency pair, so ``R(p + Δ) = R(Δ)·R(p)`` (spec A0): a key rotated at its
segment-local position is re-rotated to its place in a new prompt without recomputing it. This holds for
partial rotary (only the leading r dims of a head rotate) and for YaRN/linear frequencies. The Δ rotation
uses *unscaled* cos/sin: a YaRN ``attention_factor`` is already inside the cached key and must not be
applied a second time. Values carry no position and are never touched.

Legend: T = tokens, Hkv = kv heads, D = head dim, r = rotary dims, P = pages, S = page size,
R = kv_lora_rank, Dr = MLA rope dims.
"""

from __future__ import annotations

import torch

from nebula_engine.kernels.pic_dispatch import pic_op
from nebula_engine.model.rotary import RotaryEmbedding, apply_rotary

Delta = int | torch.Tensor  # one shift for all tokens, or a LongTensor [T] of per-token shifts


def shift_keys(k: torch.Tensor, delta: Delta, rotary: RotaryEmbedding) -> torch.Tensor:
    """k [T, Hkv, D] rotated at positions p -> the same keys as if rotated at p + delta (a new tensor)."""
    rotary_dim = 2 * rotary.inv_freq.numel()
    if rotary_dim > k.shape[-1]:
        raise ValueError(f"rotary dim {rotary_dim} exceeds head dim {k.shape[-1]}")
    cos, sin = rotary.cos_sin(_delta_positions(delta, k.shape[0], k.device), scaled=False)  # [T or 1, r/2]
    return apply_rotary(k, cos, sin, rotary.style)


def _delta_positions(delta: Delta, num_tokens: int, device: torch.device) -> torch.Tensor:
    """The Δ per token as positions for ``cos_sin``: [1] (broadcast over tokens) or [T]."""
    if isinstance(delta, torch.Tensor):
        if delta.is_floating_point() or delta.dim() > 1 or delta.numel() not in (1, num_tokens):
            raise ValueError(f"delta must be an int or an integer tensor of {num_tokens} shifts, got {delta!r}")
        return delta.reshape(-1).to(device)
    return torch.tensor([int(delta)], dtype=torch.int64, device=device)


def shift_cached_keys(cache: torch.Tensor, slots: torch.Tensor, delta: Delta, rotary: RotaryEmbedding,
                      latent_rope_dim: int | None = None) -> None:
    """In place, the tokens at flat ``slots`` [T] of one layer's key cache, each by its own ``delta``.

    ``cache`` is a K cache [P, S, Hkv, D] (leading rotary dims re-rotated) or, with ``latent_rope_dim`` Dr, an
    MLA latent cache [P, S, R + Dr] (its last Dr columns, k_pe, re-rotated).
    """
    rotary_dim = 2 * rotary.inv_freq.numel()
    cos, sin = rotary.cos_sin(_delta_positions(delta, slots.numel(), cache.device), scaled=False)
    rotate = pic_op("rotate_cached_keys", cache.device)
    interleaved = rotary.style == "interleaved"
    if latent_rope_dim is None:
        rotate(cache.view(-1, *cache.shape[2:]), slots, cos, sin, rotary_dim, interleaved)
    else:
        if rotary_dim != latent_rope_dim:
            raise ValueError(f"rotary rotates {rotary_dim} dims, k_pe has {latent_rope_dim}")
        rotate(cache.view(-1, cache.shape[-1]), slots, cos, sin, rotary_dim, interleaved,
               col_offset=cache.shape[-1] - latent_rope_dim)

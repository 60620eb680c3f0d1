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

from typing import Sequence

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


def shift_key_pages(k_cache: torch.Tensor, pages: Sequence[int] | torch.Tensor, num_tokens: int, delta: Delta,
                    rotary: RotaryEmbedding) -> None:
    """In place: the first ``num_tokens`` tokens held by ``pages`` (in order) of k_cache [P, S, Hkv, D].

    Only those slots' leading rotary dims are written; other pages, the tail slots of the last page and
    the pass-through dims of partial rotary keep their bytes.
    """
    page_ids, slots = _token_slots(pages, num_tokens, k_cache.shape[1], k_cache.device)
    rotary_dim = 2 * rotary.inv_freq.numel()
    shifted = shift_keys(k_cache[page_ids, slots, :, :rotary_dim], delta, rotary)  # [T, Hkv, r]
    k_cache[page_ids, slots, :, :rotary_dim] = shifted


def shift_latent_pages(latent_cache: torch.Tensor, pages: Sequence[int] | torch.Tensor, num_tokens: int,
                       delta: Delta, rotary: RotaryEmbedding, rope_dim: int) -> None:
    """In place, MLA latent layout latent_cache [P, S, R + Dr]: re-rotate only each token's k_pe (the last
    Dr = ``rope_dim`` columns, interleaved pairs); the latent c̃ carries no position."""
    if 2 * rotary.inv_freq.numel() != rope_dim:
        raise ValueError(f"rotary rotates {2 * rotary.inv_freq.numel()} dims, k_pe has {rope_dim}")
    page_ids, slots = _token_slots(pages, num_tokens, latent_cache.shape[1], latent_cache.device)
    k_pe = latent_cache[page_ids, slots, -rope_dim:]  # [T, Dr]
    latent_cache[page_ids, slots, -rope_dim:] = shift_keys(k_pe[:, None, :], delta, rotary)[:, 0]


def _delta_positions(delta: Delta, num_tokens: int, device: torch.device) -> torch.Tensor:
    """The Δ per token as positions for ``cos_sin``: [1] (broadcast over tokens) or [T]."""
    if isinstance(delta, torch.Tensor):
        if delta.is_floating_point() or delta.dim() > 1 or delta.numel() not in (1, num_tokens):
            raise ValueError(f"delta must be an int or an integer tensor of {num_tokens} shifts, got {delta!r}")
        return delta.reshape(-1).to(device)
    return torch.tensor([int(delta)], dtype=torch.int64, device=device)


def _token_slots(pages: Sequence[int] | torch.Tensor, num_tokens: int, page_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Page id and slot [T] of each of the first ``num_tokens`` tokens laid out across ``pages``."""
    pages = torch.as_tensor(pages, dtype=torch.int64, device=device).reshape(-1)
    if not 0 <= num_tokens <= pages.numel() * page_size:
        raise ValueError(f"{num_tokens} tokens do not fit in {pages.numel()} pages of {page_size}")
    token = torch.arange(num_tokens, device=device)
    return pages[token // page_size], token % page_size


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

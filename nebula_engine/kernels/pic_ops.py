"""Ops of position-independent caching (PIC): torch references, importable anywhere (CPU included).

Legend: T = tokens, Tq = query tokens, H = query heads, Hkv = kv heads, D = q/k head dim, Dv = v head dim,
P = pages, S = page size, N = P * S flat slots, W = latent row width (R + Dr), r = rotary dims,
dk = key head dim of a gated-delta layer.

- ``rotate_cached_keys``: re-rotate cached post-RoPE keys in place (R(p + Δ) = R(Δ) R(p)).
- ``kv_deviation`` / ``select_top_tokens``: CacheBlend's per-token deviation and top-k token choice.
- ``scattered_paged_attention``: queries at arbitrary positions of one sequence over its paged KV with the
  exact per-row causal mask of the blended-prefill primitive (spec B).
- ``gated_delta_transition``: HYPIC's segment operator M = A_T ... A_1 of a gated delta rule layer.

The Triton versions in ``kernels.triton_pic`` share these signatures and are tested against them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nebula_engine.kernels.attention import gather_kv
from nebula_engine.kernels.gated_delta_rule import chunk_gated_delta_rule


def rotate_cached_keys(cache: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rotary_dim: int, interleaved: bool, col_offset: int = 0) -> None:
    """In place: rotate columns ``[col_offset, col_offset + rotary_dim)`` of the rows ``slots`` of a flat-slot cache.

    ``cache`` is one of two flat views (views share storage, so the pool itself is updated):
      - [N, Hkv, D]: a K cache, ``k_cache.view(-1, Hkv, D)``; every head of a row is rotated alike;
        ``col_offset`` is 0 (the leading r dims rotate; partial-rotary tail dims keep their bytes).
      - [N, W]: an MLA latent cache, ``latent_cache.view(-1, R + Dr)``; k_pe is the last Dr columns,
        so ``col_offset = W - Dr`` and ``rotary_dim = Dr``; c̃ keeps its bytes.
    ``slots`` [T] int64: distinct flat slots ``page * S + offset``. ``cos``/``sin`` [T, r/2] (row t rotates slot
    t) or [1, r/2] (one rotation for all rows), any float dtype, used in fp32. Pairs are ``(i, i + r/2)``
    (neox) or ``(2i, 2i + 1)`` (``interleaved``) of the rotated columns; each pair becomes
    ``(x1 cos - x2 sin, x2 cos + x1 sin)``, computed in fp32 and rounded once to ``cache.dtype``.
    With cos/sin of the shift Δ (unscaled, see pic.rope_shift) this moves keys from position p to p + Δ.
    """
    rows = check_rotation_args(cache, slots, cos, sin, rotary_dim, col_offset)
    columns = slice(col_offset, col_offset + rotary_dim)
    part = cache[slots][..., columns].float().reshape(slots.numel(), -1, rotary_dim)  # [T, Hkv or 1, r]
    cos, sin = cos.float()[:, None, :], sin.float()[:, None, :]  # [T or 1, 1, r/2]
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = part.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    cache[slots, ..., columns] = rotated.view(rows).to(cache.dtype)


def check_rotation_args(cache, slots, cos, sin, rotary_dim, col_offset) -> tuple[int, ...]:
    """Validate ``rotate_cached_keys`` arguments; returns the shape of the rotated part [T, (Hkv,) r]."""
    if cache.dim() not in (2, 3):
        raise ValueError(f"cache must be a flat-slot view [N, Hkv, D] or [N, W], got shape {tuple(cache.shape)}")
    if slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError(f"slots must be a 1-D int64 tensor, got {slots.dtype} of shape {tuple(slots.shape)}")
    if rotary_dim <= 0 or rotary_dim % 2 or not 0 <= col_offset <= cache.shape[-1] - rotary_dim:
        raise ValueError(f"rotary columns [{col_offset}, {col_offset + rotary_dim}) must be an even, non-empty "
                         f"range inside a row of {cache.shape[-1]}")
    expected = {(slots.numel(), rotary_dim // 2), (1, rotary_dim // 2)}
    if tuple(cos.shape) not in expected or cos.shape != sin.shape:
        raise ValueError(f"cos/sin must be [{slots.numel()} or 1, {rotary_dim // 2}], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    return (slots.numel(), *cache.shape[1:-1], rotary_dim)


def kv_deviation(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Per token, Σ (new - old)² over every non-token dim, in fp32: old, new [T, ...] -> [T]."""
    if old.shape != new.shape or old.dim() == 0:
        raise ValueError(f"old and new must share a [T, ...] shape, got {tuple(old.shape)} and {tuple(new.shape)}")
    diff = new.float() - old.float()
    return diff.square().reshape(diff.shape[0], math.prod(diff.shape[1:])).sum(dim=1)


def select_top_tokens(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest of ``scores`` [T], ascending; among equal scores the lower index wins.

    NaN ranks above every number (``torch.sort``'s order), so a NaN deviation is always recomputed.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [T], got shape {tuple(scores.shape)}")
    if not 0 <= k <= scores.numel():
        raise ValueError(f"k must be in [0, {scores.numel()}], got {k}")
    order = torch.sort(scores, descending=True, stable=True).indices  # stable: ties keep index order
    return order[:k].sort().values


def scattered_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_table: torch.Tensor, seq_len: int, q_positions: torch.Tensor, scale: float,
                              sliding_window: int | None = None) -> torch.Tensor:
    """Queries at arbitrary positions of ONE sequence over its first ``seq_len`` cached tokens.

    q [Tq, H, D]; k_cache [P, S, Hkv, D], v_cache [P, S, Hkv, Dv] (layout of ``kernels.attention``);
    block_table [>= ceil(seq_len / S)] int64 page ids of the sequence; q_positions [Tq] int64, sorted and
    distinct absolute positions in [0, seq_len). Row i attends to keys j <= q_positions[i] (and
    j > q_positions[i] - W with ``sliding_window`` W). The queries' own K/V must already be in the cache.
    H is a multiple of Hkv (GQA). Returns [Tq, H, Dv] in q's dtype.
    """
    check_scattered_args(q, k_cache, v_cache, block_table, seq_len, q_positions)
    if q_positions.numel() and not (0 <= int(q_positions.min()) and int(q_positions.max()) < seq_len):
        raise ValueError(f"q_positions must lie in [0, {seq_len})")
    k, v = gather_kv(k_cache, v_cache, block_table, seq_len)  # [L, Hkv, D], [L, Hkv, Dv]
    keys = torch.arange(seq_len, device=q.device)
    positions = q_positions.to(q.device)[:, None]
    mask = keys[None, :] <= positions  # [Tq, L]
    if sliding_window is not None:
        mask &= keys[None, :] > positions - sliding_window
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k.to(q.dtype), v.to(q.dtype)))  # [1, heads, L, d]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                         enable_gqa=kh.shape[1] != qh.shape[1])
    return out[0].transpose(0, 1)


def check_scattered_args(q, k_cache, v_cache, block_table, seq_len, q_positions) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError("expected q [Tq, H, D], k_cache [P, S, Hkv, D], v_cache [P, S, Hkv, Dv]")
    if q.shape[-1] != k_cache.shape[-1] or q.shape[1] % k_cache.shape[2] or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if q_positions.shape != (q.shape[0],) or q_positions.is_floating_point():
        raise ValueError(f"q_positions must be an integer tensor [{q.shape[0]}], got {q_positions!r}")
    pages = -(-seq_len // k_cache.shape[1])
    if seq_len <= 0 or block_table.dim() != 1 or block_table.numel() < pages:
        raise ValueError(f"seq_len {seq_len} needs a 1-D block_table of >= {pages} pages, got "
                         f"{tuple(block_table.shape)}")


def gated_delta_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           chunk_size: int = 64) -> torch.Tensor:
    """HYPIC's segment operator M = A_T ... A_1, A_t = exp(g_t)(I - β_t k_t k_tᵀ), per head: [H, dk, dk] fp32.

    k [T, H, dk] (L2-normalised, repeated to the value heads); g (log-decay), beta [T, H]. It is the final
    state of the gated delta rule run with v = 0 from S_0 = I, so for any state S [H, dk, dv] the segment
    maps S to ``M @ S + N``, N being the segment's final state from a zero start.
    """
    if k.dim() != 3 or g.shape != k.shape[:2] or beta.shape != k.shape[:2]:
        raise ValueError(f"expected k [T, H, dk], g and beta [T, H]; got {tuple(k.shape)}, {tuple(g.shape)}, "
                         f"{tuple(beta.shape)}")
    heads, dk = k.shape[1], k.shape[2]
    identity = torch.eye(dk, dtype=torch.float32, device=k.device).expand(heads, dk, dk)
    if k.shape[0] == 0:
        return identity.clone()
    zeros = torch.zeros_like(k)
    _, transition = chunk_gated_delta_rule(zeros, k, zeros, g, beta, initial_state=identity, chunk_size=chunk_size)
    return transition

"""PIC op references against the math written out and against the functions they must agree with."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nebula_engine.kernels.attention import causal_attention, gather_kv
from nebula_engine.kernels.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from nebula_engine.kernels.pic_ops import (gated_delta_transition, kv_deviation, rotate_cached_keys,
                                           scattered_paged_attention, select_top_tokens)
from nebula_engine.model.config import RopeConfig
from nebula_engine.model.rotary import RotaryEmbedding
from nebula_engine.pic.rope_shift import shift_keys

PAGE_SIZE = 4


def randn(*shape: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def flat_slots(pages: list[int], num_tokens: int) -> torch.Tensor:
    return torch.tensor([pages[i // PAGE_SIZE] * PAGE_SIZE + i % PAGE_SIZE for i in range(num_tokens)])


def shift_columns(cache: torch.Tensor, pages: list[int], num_tokens: int, delta, rotary: RotaryEmbedding,
                  columns: slice) -> None:
    """The reference: ``shift_keys`` over the ``columns`` of the first ``num_tokens`` slots of ``pages``, in place."""
    slots = flat_slots(pages, num_tokens)
    page_ids, offsets = slots // PAGE_SIZE, slots % PAGE_SIZE
    rows = cache[page_ids, offsets][..., columns]
    shifted = shift_keys(rows if rows.dim() == 3 else rows[:, None, :], delta, rotary)
    cache[page_ids, offsets, ..., columns] = shifted if rows.dim() == 3 else shifted[:, 0]


# ---- rotate_cached_keys ------------------------------------------------------------------------------

@pytest.mark.parametrize("style,rotary_dim,head_dim", [("neox", 16, 16), ("neox", 8, 32), ("interleaved", 16, 16)])
@pytest.mark.parametrize("delta", [37, torch.arange(10) * 3 - 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_matches_shift_keys(style, rotary_dim, head_dim, delta, dtype):
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0, rotary_dim=rotary_dim, style=style))
    cache = randn(7, PAGE_SIZE, 3, head_dim, seed=1, dtype=dtype)
    pages, num_tokens = [5, 2, 6], 10  # the last page only half full: its tail must keep its bytes
    expected = cache.clone()
    shift_columns(expected, pages, num_tokens, delta, rotary, slice(0, rotary_dim))

    positions = delta.reshape(-1) if isinstance(delta, torch.Tensor) else torch.tensor([delta])
    cos, sin = rotary.cos_sin(positions, scaled=False)
    rotate_cached_keys(cache.view(-1, 3, head_dim), flat_slots(pages, num_tokens), cos, sin, rotary_dim,
                       interleaved=style == "interleaved")
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


@pytest.mark.parametrize("delta", [-3, torch.tensor([4, 0, 9, 1, 2, 100])])
def test_rotate_latent_rows_matches_shift_keys(delta):
    rank, rope_dim = 12, 8
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0, rotary_dim=rope_dim, style="interleaved"))
    cache = randn(5, PAGE_SIZE, rank + rope_dim, seed=2)
    pages, num_tokens = [3, 0], 6
    expected = cache.clone()
    shift_columns(expected, pages, num_tokens, delta, rotary, slice(rank, rank + rope_dim))

    positions = delta if isinstance(delta, torch.Tensor) else torch.tensor([delta])
    cos, sin = rotary.cos_sin(positions, scaled=False)
    rotate_cached_keys(cache.view(-1, rank + rope_dim), flat_slots(pages, num_tokens), cos, sin, rope_dim,
                       interleaved=True, col_offset=rank)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_is_complex_multiplication_of_the_pairs(interleaved):
    """Each pair (x1, x2) becomes (x1 + i x2) e^{iθ}: checked with complex numbers, pairing by style."""
    cache = randn(6, 2, 10, seed=3)
    angles = randn(2, 3, seed=4)  # r = 6 of D = 10 rotated, from column 2
    slots = torch.tensor([4, 1])
    before = cache.clone()
    rotate_cached_keys(cache, slots, angles.cos(), angles.sin(), 6, interleaved, col_offset=2)

    part = before[slots, :, 2:8]
    x1, x2 = (part[..., 0::2], part[..., 1::2]) if interleaved else (part[..., :3], part[..., 3:])
    turned = torch.complex(x1, x2) * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    after = cache[slots, :, 2:8]
    y1, y2 = (after[..., 0::2], after[..., 1::2]) if interleaved else (after[..., :3], after[..., 3:])
    torch.testing.assert_close(torch.complex(y1, y2), turned, atol=1e-6, rtol=1e-6)
    untouched = torch.ones(6, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(cache[untouched], before[untouched])
    assert torch.equal(cache[slots][..., :2], before[slots][..., :2])
    assert torch.equal(cache[slots][..., 8:], before[slots][..., 8:])


def test_rotate_rejects_bad_arguments():
    cache, slots, angle = torch.zeros(4, 2, 8), torch.tensor([0, 1]), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="flat-slot"):
        rotate_cached_keys(torch.zeros(2, 4, 2, 8), slots, angle, angle, 4, False)
    with pytest.raises(ValueError, match="rotary columns"):
        rotate_cached_keys(cache, slots, angle, angle, 4, False, col_offset=6)
    with pytest.raises(ValueError, match="cos/sin"):
        rotate_cached_keys(cache, slots, torch.zeros(3, 2), torch.zeros(3, 2), 4, False)
    with pytest.raises(ValueError, match="int64"):
        rotate_cached_keys(cache, slots.int(), angle, angle, 4, False)


# ---- kv_deviation / select_top_tokens ----------------------------------------------------------------

@pytest.mark.parametrize("shape", [(5,), (6, 4), (3, 2, 5), (0, 3)])
def test_kv_deviation_sums_squares_over_non_token_dims(shape):
    old, new = randn(*shape, seed=5).bfloat16(), randn(*shape, seed=6).bfloat16()
    out = kv_deviation(old, new)
    assert out.dtype == torch.float32 and out.shape == (shape[0],)
    for t in range(shape[0]):
        expected = sum(float(n) ** 2 for n in (new[t].float() - old[t].float()).reshape(-1))
        assert math.isclose(float(out[t]), expected, rel_tol=1e-5)


def test_select_top_tokens_breaks_ties_by_lower_index():
    scores = torch.tensor([1.0, 5.0, 3.0, 5.0, 3.0, 3.0, 0.0, 5.0])
    for k in range(scores.numel() + 1):
        expected = sorted(sorted(range(8), key=lambda i: (-float(scores[i]), i))[:k])
        assert select_top_tokens(scores, k).tolist() == expected
    assert select_top_tokens(scores, 0).dtype == torch.int64
    with pytest.raises(ValueError):
        select_top_tokens(scores, 9)


# ---- scattered_paged_attention -----------------------------------------------------------------------

def _paged(pages: list[int], length: int, kv_heads: int, head_dim: int, v_dim: int, seed: int):
    k_cache, v_cache = randn(12, PAGE_SIZE, kv_heads, head_dim, seed=seed), randn(12, PAGE_SIZE, kv_heads, v_dim,
                                                                               seed=seed + 1)
    return k_cache, v_cache, torch.tensor(pages)


def _attention_by_rows(q, k, v, positions, scale, window):
    """Softmax written out for each query row and head."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
    for i, pos in enumerate(positions.tolist()):
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(q.shape[1]):
            keys, values = k[lo: pos + 1, h // group], v[lo: pos + 1, h // group]
            out[i, h] = torch.softmax(keys @ q[i, h] * scale, dim=0) @ values
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim,v_dim", [(4, 4, 8, 8), (6, 2, 8, 12), (4, 1, 16, 8)])
@pytest.mark.parametrize("window", [None, 3, 6])
def test_scattered_attention_matches_per_row_softmax(heads, kv_heads, head_dim, v_dim, window):
    length = 18
    k_cache, v_cache, table = _paged([7, 2, 9, 0, 11], length, kv_heads, head_dim, v_dim, seed=7)
    positions = torch.tensor([0, 1, 5, 8, 9, 14, 17])  # interior rows and the suffix, like EPIC's F
    q = randn(positions.numel(), heads, head_dim, seed=8)
    out = scattered_paged_attention(q, k_cache, v_cache, table, length, positions, 0.4, window)
    k, v = gather_kv(k_cache, v_cache, table, length)
    torch.testing.assert_close(out, _attention_by_rows(q, k, v, positions, 0.4, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_scattered_attention_over_a_suffix_is_causal_attention(window):
    length, q_len = 13, 5
    k_cache, v_cache, table = _paged([3, 8, 1, 4], length, 2, 8, 8, seed=9)
    q = randn(q_len, 4, 8, seed=10)
    out = scattered_paged_attention(q, k_cache, v_cache, table, length, torch.arange(length - q_len, length), 0.5,
                                    window)
    k, v = gather_kv(k_cache, v_cache, table, length)
    torch.testing.assert_close(out, causal_attention(q, k, v, 0.5, window), atol=1e-5, rtol=1e-5)


def test_scattered_attention_rejects_positions_outside_the_context():
    k_cache, v_cache, table = _paged([0, 1], 6, 1, 8, 8, seed=11)
    with pytest.raises(ValueError, match="q_positions"):
        scattered_paged_attention(randn(1, 1, 8), k_cache, v_cache, table, 6, torch.tensor([6]), 1.0)
    with pytest.raises(ValueError, match="block_table"):
        scattered_paged_attention(randn(1, 1, 8), k_cache, v_cache, table, 9, torch.tensor([2]), 1.0)


# ---- gated_delta_transition --------------------------------------------------------------------------

def _gdn_inputs(tokens: int, heads: int, dk: int, dv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(tokens, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(tokens, heads, dk, generator=gen), dim=-1)
    v = torch.randn(tokens, heads, dv, generator=gen)
    g = -torch.rand(tokens, heads, generator=gen) * 0.1  # mild decay: M stays far from 0 over a segment
    beta = torch.rand(tokens, heads, generator=gen)
    return q, k, v, g, beta, torch.randn(heads, dk, dv, generator=gen)


@pytest.mark.parametrize("tokens,heads,dk,dv,chunk", [(1, 1, 4, 4, 4), (9, 2, 8, 4, 4), (37, 3, 16, 8, 16),
                                                      (70, 2, 16, 32, 64)])
def test_segment_maps_any_state_affinely_through_the_transition(tokens, heads, dk, dv, chunk):
    """Chunk rule from S equals M @ S + N (N from a zero start), checked against the plain recurrence."""
    q, k, v, g, beta, state = _gdn_inputs(tokens, heads, dk, dv, seed=tokens)
    transition = gated_delta_transition(k, g, beta, chunk_size=chunk)
    assert transition.shape == (heads, dk, dk) and transition.dtype == torch.float32
    _, zero_start_end = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)
    _, expected = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(transition @ state + zero_start_end, expected, atol=1e-5, rtol=1e-5)


def test_transition_is_the_product_of_the_per_token_factors():
    _, k, _, g, beta, _ = _gdn_inputs(6, 2, 4, 4, seed=12)
    expected = torch.eye(4).repeat(2, 1, 1)
    for t in range(6):
        outer = k[t, :, :, None] * k[t, :, None, :]  # [H, dk, dk]
        factor = g[t].exp()[:, None, None] * (torch.eye(4) - beta[t][:, None, None] * outer)
        expected = factor @ expected
    torch.testing.assert_close(gated_delta_transition(k, g, beta, chunk_size=4), expected, atol=1e-6, rtol=1e-5)


def test_transitions_compose_across_a_split_segment():
    """(M2, N2) ∘ (M1, N1) = (M2 M1, M2 N1 + N2): the whole segment's operator from its two halves."""
    q, k, v, g, beta, _ = _gdn_inputs(21, 2, 8, 8, seed=13)
    whole_m = gated_delta_transition(k, g, beta, chunk_size=8)
    _, whole_n = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8)
    m1, m2 = gated_delta_transition(k[:8], g[:8], beta[:8], 8), gated_delta_transition(k[8:], g[8:], beta[8:], 8)
    _, n1 = chunk_gated_delta_rule(q[:8], k[:8], v[:8], g[:8], beta[:8], chunk_size=8)
    _, n2 = chunk_gated_delta_rule(q[8:], k[8:], v[8:], g[8:], beta[8:], chunk_size=8)
    torch.testing.assert_close(m2 @ m1, whole_m, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m2 @ n1 + n2, whole_n, atol=1e-5, rtol=1e-5)


def test_empty_segment_is_the_identity():
    k = torch.zeros(0, 3, 4)
    assert torch.equal(gated_delta_transition(k, torch.zeros(0, 3), torch.zeros(0, 3)), torch.eye(4).repeat(3, 1, 1))

"""Chunked gated delta rule equals the token-by-token recurrence, and both equal transformers' reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule as hf_recurrent

from nebula_engine.kernels.gated_delta_rule import (chunk_gated_delta_rule, gated_delta_step,
                                                   recurrent_gated_delta_rule)


def _inputs(tokens: int, heads: int, dk: int, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(tokens, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(tokens, heads, dk, generator=gen), dim=-1)
    v = torch.randn(tokens, heads, dv, generator=gen)
    g = -torch.rand(tokens, heads, generator=gen) * 2.0  # log-decay in (-2, 0]
    beta = torch.rand(tokens, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


SHAPES = [  # (tokens, heads, dk, dv, chunk_size)
    (1, 1, 4, 4, 4), (5, 2, 8, 4, 4), (8, 2, 8, 8, 4), (13, 3, 16, 8, 4),
    (31, 2, 8, 16, 8), (64, 4, 16, 16, 64), (70, 2, 16, 8, 64), (129, 1, 32, 32, 16),
]


@pytest.mark.parametrize("tokens,heads,dk,dv,chunk", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(tokens, heads, dk, dv, chunk, with_state):
    q, k, v, g, beta, state = _inputs(tokens, heads, dk, dv)
    initial = state if with_state else None
    out_r, state_r = recurrent_gated_delta_rule(q, k, v, g, beta, initial)
    out_c, state_c = chunk_gated_delta_rule(q, k, v, g, beta, initial, chunk_size=chunk)
    assert out_c.shape == (tokens, heads, dv) and state_c.shape == (heads, dk, dv)
    assert out_r.abs().max() > 0.01  # not trivially zero
    torch.testing.assert_close(out_c, out_r, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(state_c, state_r, atol=2e-5, rtol=2e-5)


def test_recurrent_matches_transformers_reference():
    """HF's kernel normalises and scales q/k itself: feed it raw q/k, ours the normalised ones."""
    tokens, heads, dk, dv = 9, 2, 8, 4
    gen = torch.Generator().manual_seed(3)
    q_raw, k_raw = torch.randn(2, tokens, heads, dk, generator=gen)
    v = torch.randn(tokens, heads, dv, generator=gen)
    g, beta = -torch.rand(tokens, heads, generator=gen), torch.rand(tokens, heads, generator=gen)
    q = q_raw * torch.rsqrt((q_raw * q_raw).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    k = k_raw * torch.rsqrt((k_raw * k_raw).sum(-1, keepdim=True) + 1e-6)
    ours, our_state = recurrent_gated_delta_rule(q, k, v, g, beta)
    ref, ref_state = hf_recurrent(q_raw[None], k_raw[None], v[None], g[None], beta[None],
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(our_state, ref_state[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
def test_split_sequence_continues_from_state(kernel):
    q, k, v, g, beta, _ = _inputs(23, 2, 8, 8, seed=1)
    full_out, full_state = kernel(q, k, v, g, beta)
    head_out, head_state = kernel(q[:10], k[:10], v[:10], g[:10], beta[:10])
    tail_out, tail_state = kernel(q[10:], k[10:], v[10:], g[10:], beta[10:], head_state)
    torch.testing.assert_close(torch.cat([head_out, tail_out]), full_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(tail_state, full_state, atol=2e-5, rtol=2e-5)


def test_initial_state_is_not_modified():
    q, k, v, g, beta, state = _inputs(6, 2, 4, 4)
    before = state.clone()
    for kernel in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        kernel(q, k, v, g, beta, state)
    assert torch.equal(state, before)


@pytest.mark.parametrize("batch,heads,dk,dv", [(1, 1, 4, 4), (5, 3, 8, 16), (4, 8, 32, 32)])
def test_batched_step_equals_recurrent_per_sequence(batch, heads, dk, dv):
    rows = [_inputs(1, heads, dk, dv, seed=b) for b in range(batch)]
    q, k, v, g, beta = (torch.cat([r[i] for r in rows]) for i in range(5))  # token b is sequence b's
    states = torch.stack([r[5] for r in rows])
    before = states.clone()
    out, new_states = gated_delta_step(q, k, v, g, beta, states)
    assert torch.equal(states, before)
    for b, (qb, kb, vb, gb, betab, state) in enumerate(rows):
        expected_out, expected_state = recurrent_gated_delta_rule(qb, kb, vb, gb, betab, state)
        torch.testing.assert_close(out[b:b + 1], expected_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new_states[b], expected_state, atol=1e-5, rtol=1e-5)

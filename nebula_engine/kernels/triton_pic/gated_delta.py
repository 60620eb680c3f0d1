"""Triton chunked gated delta rule (the WY/UT form of ``kernels.gated_delta_rule``), plus its transition mode.

Grid: (H, value-column blocks). The recurrence never mixes value columns (S_t = A_t S_{t-1} + β_t k_t v_tᵀ
acts on each column of S alone), so a program owns S[:, BLOCK_V columns] of one head in registers and walks
the chunks in order; the per-chunk key algebra (decay Γ, (I + L)⁻¹ by forward substitution, W) is
recomputed by each column block. All arithmetic is fp32 (IEEE products); the state is fp32 in and out.

Transition mode (HYPIC): v = 0 and S_0 = I, so the final state is M = A_T ... A_1 [H, dk, dk]; no q, v or
output is read or written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nebula_engine.kernels.triton_pic._launch import block, check_devices


@triton.jit
def _dot(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _chunk_gated_delta_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_in_ptr, out_ptr, state_out_ptr, num_tokens, heads,
        DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
        HAS_INITIAL: tl.constexpr, TRANSITION: tl.constexpr):
    # q, k [T, H, DK], v and out [T, H, DV], g and beta [T, H], states [H, DK, DV]: all contiguous
    head = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    c = tl.arange(0, CHUNK)
    k_ok = kk < DK
    v_ok = vv < DV
    state_at = head * DK * DV + kk[:, None] * DV + vv[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    if HAS_INITIAL:
        state = tl.load(state_in_ptr + state_at, mask=state_ok, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    causal = c[:, None] >= c[None, :]
    diagonal = c[:, None] == c[None, :]

    for start in range(0, num_tokens, CHUNK):
        t = start + c
        t_ok = t < num_tokens  # padded rows: k = v = q = 0, g = β = 0, so they change nothing
        key_at = (t[:, None] * heads + head) * DK + kk[None, :]
        key_ok = t_ok[:, None] & k_ok[None, :]
        k = tl.load(k_ptr + key_at, mask=key_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * heads + head, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * heads + head, mask=t_ok, other=0.0).to(tl.float32)
        gamma = tl.cumsum(g, axis=0)
        decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], -1.0e30))  # Γ, 0 above the diagonal
        k_beta = k * beta[:, None]
        lower = tl.where(diagonal, 0.0, _dot(k_beta, tl.trans(k)) * decay)  # strictly lower L

        inverse = tl.where(diagonal, 1.0, 0.0)  # (I + L)⁻¹, row i = e_i - Σ_{j<i} L_ij row j
        for i in range(1, CHUNK):
            l_row = tl.sum(tl.where(c[:, None] == i, lower, 0.0), axis=0)
            inverse = tl.where(c[:, None] == i, inverse - tl.sum(l_row[:, None] * inverse, axis=0)[None, :], inverse)

        w = _dot(inverse, k_beta * tl.exp(gamma)[:, None])  # [C, BLOCK_K]
        v_new = -_dot(w, state)  # [C, BLOCK_V]: U - W S with U = 0 in transition mode
        if not TRANSITION:
            value_at = (t[:, None] * heads + head) * DV + vv[None, :]
            value_ok = t_ok[:, None] & v_ok[None, :]
            v = tl.load(v_ptr + value_at, mask=value_ok, other=0.0).to(tl.float32)
            v_new += _dot(inverse, v * beta[:, None])
            q = tl.load(q_ptr + key_at, mask=key_ok, other=0.0).to(tl.float32)
            intra = _dot(q, tl.trans(k)) * decay
            out = _dot(q * tl.exp(gamma)[:, None], state) + _dot(intra, v_new)
            tl.store(out_ptr + value_at, out.to(out_ptr.dtype.element_ty), mask=value_ok)
        gamma_last = tl.sum(tl.where(c == CHUNK - 1, gamma, 0.0), axis=0)
        k_to_end = k * tl.exp(gamma_last - gamma)[:, None]
        state = state * tl.exp(gamma_last) + _dot(tl.trans(k_to_end), v_new)

    tl.store(state_out_ptr + state_at, state, mask=state_ok)


def _check(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk_size: int) -> None:
    if k.dim() != 3 or g.shape != k.shape[:2] or beta.shape != k.shape[:2]:
        raise ValueError(f"expected k [T, H, dk], g and beta [T, H]; got {tuple(k.shape)}, {tuple(g.shape)}, "
                         f"{tuple(beta.shape)}")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two chunk_size >= 16, got {chunk_size}")


def _launch(q, k, v, g, beta, state_in, out, state_out, value_dim: int, chunk_size: int, transition: bool) -> None:
    tokens, heads, key_dim = k.shape
    block_k = block(key_dim)
    block_v = min(block(value_dim), 32 if block_k >= 128 else 64)
    grid = (heads, triton.cdiv(value_dim, block_v))
    _chunk_gated_delta_kernel[grid](
        q, k, v, g, beta, state_in, out, state_out, tokens, heads,
        DK=key_dim, DV=value_dim, BLOCK_K=block_k, BLOCK_V=block_v, CHUNK=chunk_size,
        HAS_INITIAL=state_in is not None, TRANSITION=transition, num_warps=8 if block_k >= 128 else 4)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None, chunk_size: int = 64
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, dk]; v [T, H, dv]; g, beta [T, H] -> (o [T, H, dv] in v's dtype, final state [H, dk, dv] fp32)."""
    _check(k, g, beta, chunk_size)
    tokens, heads, key_dim = k.shape
    if q.shape != k.shape or v.dim() != 3 or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"expected q, k [T, H, dk] and v [T, H, dv]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    value_dim = v.shape[2]
    if initial_state is not None and initial_state.shape != (heads, key_dim, value_dim):
        raise ValueError(f"initial_state must be [{heads}, {key_dim}, {value_dim}], got {tuple(initial_state.shape)}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    state_in = None if initial_state is None else initial_state.float().contiguous()
    out = torch.empty_like(v)
    state_out = torch.empty(heads, key_dim, value_dim, dtype=torch.float32, device=k.device)
    check_devices(*(x for x in (q, k, v, g, beta, state_in) if x is not None))
    _launch(q, k, v, g, beta, state_in, out, state_out, value_dim, chunk_size, transition=False)
    return out, state_out


def gated_delta_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """M = A_T ... A_1 [H, dk, dk] fp32, as ``pic_ops.gated_delta_transition``."""
    _check(k, g, beta, chunk_size)
    heads, key_dim = k.shape[1], k.shape[2]
    k, g, beta = (x.contiguous() for x in (k, g, beta))
    identity = torch.eye(key_dim, dtype=torch.float32, device=k.device).expand(heads, key_dim, key_dim).contiguous()
    transition = torch.empty_like(identity)
    check_devices(k, g, beta)
    # q, v and out are never touched in transition mode: k and the state stand in for the pointers
    _launch(k, k, k, g, beta, identity, transition, transition, key_dim, chunk_size, transition=True)
    return transition

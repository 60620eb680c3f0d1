"""Gated delta rule (Gated DeltaNet's linear attention): torch references per sequence, one batched decode step.

Legend: T = tokens, H = heads (value heads; q/k are already repeated to H), dk/dv = key/value head dims,
C = chunk size, N = chunks. State ``S`` [H, dk, dv] per head, in fp32 (transformers' layout):

    S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,   o_t = S_tᵀ q_t,   α_t = exp(g_t)

q and k come in already L2-normalised and q already scaled; these kernels do the recurrence only.
The chunked form must equal the recurrent one (tests/kernels); prefill uses it. Decode advances every
sequence of a batch by its one new token in one call (``gated_delta_step``), which must equal the recurrent
form run per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _to_heads_first(q, k, v, g, beta):
    """[T, H, d] -> [H, T, d] and [T, H] -> [H, T], all fp32."""
    return [x.transpose(0, 1).float() for x in (q, k, v, g, beta)]


def _zero_state(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.zeros(k.shape[1], k.shape[2], v.shape[2], dtype=torch.float32, device=k.device)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, dk]; v [T, H, dv]; g (log-decay), beta [T, H] -> (o [T, H, dv], final state [H, dk, dv])."""
    state = _zero_state(k, v) if initial_state is None else initial_state.float().clone()
    q, k, v, g, beta = _to_heads_first(q, k, v, g, beta)
    out = torch.empty_like(v)  # [H, T, dv]
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[:, t])  # what S already maps k_t to
        update = (v[:, t] - predicted) * beta[:, t, None]  # [H, dv]
        state = state + k[:, t, :, None] * update[:, None, :]
        out[:, t] = torch.einsum("hkv,hk->hv", state, q[:, t])
    return out.transpose(0, 1).to(v.dtype), state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor | None = None, chunk_size: int = 64
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``recurrent_gated_delta_rule``, computed C tokens at a time (WY/UT form).

    Per chunk, γ = cumsum(g), Γ_ij = exp(γ_i - γ_j) (i >= j), L = strict_lower((diag(β)K)Kᵀ ⊙ Γ),
    U = (I+L)⁻¹ diag(β)V, W = (I+L)⁻¹ (diag(β)K ⊙ e^γ); then per chunk, in order:
    V' = U - W S;  O = (Q ⊙ e^γ) S + (QKᵀ ⊙ Γ) V';  S = e^{γ_C} S + (K ⊙ e^{γ_C - γ})ᵀ V'.
    """
    tokens, dtype = q.shape[0], v.dtype
    state = _zero_state(k, v) if initial_state is None else initial_state.float()
    q, k, v, g, beta = _to_heads_first(q, k, v, g, beta)
    pad = (-tokens) % chunk_size  # padded tokens have k = v = 0 and g = 0: they change nothing
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    heads, chunks = q.shape[0], q.shape[1] // chunk_size
    q, k, v = (x.reshape(heads, chunks, chunk_size, -1) for x in (q, k, v))  # [H, N, C, d]
    g, beta = (x.reshape(heads, chunks, chunk_size) for x in (g, beta))  # [H, N, C]

    gamma = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # Γ [H,N,C,C]
    k_beta = k * beta[..., None]
    unit_lower = (k_beta @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(chunk_size, device=q.device)
    u = torch.linalg.solve_triangular(unit_lower, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(unit_lower, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True)
    intra = q @ k.transpose(-1, -2) * decay  # [H, N, C, C], diagonal included
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [H, N, 1, 1]

    out = torch.empty_like(v)  # [H, N, C, dv]
    for i in range(chunks):
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, chunks * chunk_size, -1)[:, :tokens]
    return out.transpose(0, 1).to(dtype), state


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: q, k [B, H, dk]; v [B, H, dv]; g, beta [B, H]; state [B, H, dk, dv]
    -> (o [B, H, dv], new state [B, H, dk, dv] fp32). ``state`` is not modified."""
    k32, v32 = k.float(), v.float()
    state = state.float() * g.float().exp()[..., None, None]
    predicted = torch.matmul(k32[:, :, None, :], state)[:, :, 0]  # [B, H, dv]: what S already maps k to
    update = (v32 - predicted) * beta.float()[..., None]
    state = torch.baddbmm(state.flatten(0, 1), k32.flatten(0, 1)[:, :, None], update.flatten(0, 1)[:, None, :]
                          ).view_as(state)
    out = torch.matmul(q.float()[:, :, None, :], state)[:, :, 0]
    return out.to(v.dtype), state

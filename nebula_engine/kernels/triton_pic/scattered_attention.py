"""Triton ``scattered_paged_attention``: flash attention over one sequence's paged KV, masked per query row.

Grid: (query blocks of BLOCK_M rows, H). A program walks key blocks of BLOCK_N tokens from the window start
of its first row to its last row's position, translating each key to (page, offset) through the block
table, with an online softmax in fp32. The mask is evaluated per (row, key): key <= pos (and
key > pos - W), so rows need not be contiguous positions. Positions outside [0, seq_len) cannot read out of
bounds (keys stop at seq_len); a row that sees no key is written as zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nebula_engine.kernels.pic_ops import check_scattered_args
from nebula_engine.kernels.triton_pic._launch import block, check_devices, dot_in_fp32

@triton.jit
def _scattered_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, pos_ptr, num_queries, seq_len, scale, window,
        stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ot, stride_oh,
        GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_WINDOW: tl.constexpr, FP32_DOT: tl.constexpr):
    head = tl.program_id(1)
    kv_head = head // GROUP
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_queries
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    hi = tl.minimum(tl.max(pos, axis=0) + 1, seq_len)
    lo = 0
    if HAS_WINDOW:
        first = tl.min(tl.where(row_ok, pos, hi), axis=0)
        lo = (tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked block must not give inf - inf
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < seq_len
        page = tl.load(table_ptr + keys // PAGE_SIZE, mask=key_ok, other=0)
        offset = keys % PAGE_SIZE
        k = tl.load(k_ptr + page[:, None] * stride_kp + offset[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                    mask=key_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        v = tl.load(v_ptr + page[:, None] * stride_vp + offset[:, None] * stride_vs + kv_head * stride_vh + dv[None, :],
                    mask=key_ok[:, None] & (dv[None, :] < V_DIM), other=0.0)
        if FP32_DOT:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > pos[:, None] - window)
        scores = tl.where(visible, scores, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.where(visible, tl.exp(scores - m_new[:, None]), 0.0)  # exponent <= 0: no overflow
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < V_DIM))


def scattered_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_table: torch.Tensor, seq_len: int, q_positions: torch.Tensor, scale: float,
                              sliding_window: int | None = None) -> torch.Tensor:
    check_scattered_args(q, k_cache, v_cache, block_table, seq_len, q_positions)
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if any(x.stride(-1) != 1 for x in (q, k_cache, v_cache)):
        raise ValueError("q, k_cache and v_cache must be contiguous in their last dim")
    num_queries, heads, head_dim = q.shape
    v_dim = v_cache.shape[-1]
    out = torch.empty(num_queries, heads, v_dim, dtype=q.dtype, device=q.device)
    if num_queries == 0:
        return out
    table, positions = block_table.contiguous(), q_positions.contiguous()
    check_devices(q, k_cache, v_cache, table, positions)
    block_m = block(num_queries, floor=16) if num_queries < 64 else 64
    fp32_dot = dot_in_fp32(q.dtype)
    grid = (triton.cdiv(num_queries, block_m), heads)
    _scattered_attention_kernel[grid](
        q, k_cache, v_cache, out, table, positions, num_queries, seq_len, scale, sliding_window or 0,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1),
        GROUP=heads // k_cache.shape[2], PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, V_DIM=v_dim,
        BLOCK_D=block(head_dim), BLOCK_DV=block(v_dim), BLOCK_M=block_m, BLOCK_N=32 if fp32_dot else 64,
        HAS_WINDOW=sliding_window is not None, FP32_DOT=fp32_dot)
    return out

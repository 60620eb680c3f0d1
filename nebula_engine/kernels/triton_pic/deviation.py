"""Triton ``kv_deviation``: one program per token sums (new - old)² over the token's row in fp32."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nebula_engine.kernels.triton_pic._launch import check_devices

_BLOCK = 1024


@triton.jit
def _deviation_kernel(old_ptr, new_ptr, out_ptr, width, stride_old, stride_new, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < width
        old = tl.load(old_ptr + token * stride_old + cols, mask=valid, other=0.0).to(tl.float32)
        new = tl.load(new_ptr + token * stride_new + cols, mask=valid, other=0.0).to(tl.float32)
        diff = new - old
        total += diff * diff
    tl.store(out_ptr + token, tl.sum(total, axis=0))


def kv_deviation(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    if old.shape != new.shape or old.dim() == 0:
        raise ValueError(f"old and new must share a [T, ...] shape, got {tuple(old.shape)} and {tuple(new.shape)}")
    tokens = old.shape[0]
    width = math.prod(old.shape[1:])
    old_rows, new_rows = (x.reshape(tokens, width) for x in (old, new))
    old_rows, new_rows = (x if x.stride(-1) == 1 else x.contiguous() for x in (old_rows, new_rows))
    out = torch.empty(tokens, dtype=torch.float32, device=old.device)
    if tokens == 0:
        return out
    check_devices(old_rows, new_rows)
    _deviation_kernel[(tokens,)](old_rows, new_rows, out, width, old_rows.stride(0), new_rows.stride(0),
                                 BLOCK=min(_BLOCK, triton.next_power_of_2(max(width, 1))))
    return out

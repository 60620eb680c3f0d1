"""Triton ``rotate_cached_keys``: one program per (token, head) rotates that slot's rotary columns in place.

Contract and validation are those of ``kernels.pic_ops.rotate_cached_keys``; rows are read and written only
at ``slots`` and only in the rotated columns, so every other byte of the cache keeps its value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nebula_engine.kernels.pic_ops import check_rotation_args
from nebula_engine.kernels.triton_pic._launch import block, check_devices


@triton.jit
def _rotate_kernel(cache_ptr, slots_ptr, cos_ptr, sin_ptr, stride_row, stride_head, stride_angle, col_offset,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + token)  # int64: slot * stride_row cannot overflow
    pair = tl.arange(0, BLOCK_HALF)
    valid = pair < HALF
    base = cache_ptr + slot * stride_row + head * stride_head + col_offset
    if INTERLEAVED:
        first = 2 * pair
        second = first + 1
    else:
        first = pair
        second = pair + HALF
    x1 = tl.load(base + first, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(base + second, mask=valid, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_angle + pair, mask=valid, other=0.0)
    sin = tl.load(sin_ptr + token * stride_angle + pair, mask=valid, other=0.0)
    out_type = cache_ptr.dtype.element_ty
    tl.store(base + first, (x1 * cos - x2 * sin).to(out_type), mask=valid)
    tl.store(base + second, (x2 * cos + x1 * sin).to(out_type), mask=valid)


def rotate_cached_keys(cache: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rotary_dim: int, interleaved: bool, col_offset: int = 0) -> None:
    check_rotation_args(cache, slots, cos, sin, rotary_dim, col_offset)
    if cache.stride(-1) != 1:
        raise ValueError("cache rows must be contiguous in their last dim")
    if slots.numel() == 0:
        return
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    check_devices(cache, slots, cos, sin)
    heads = cache.shape[1] if cache.dim() == 3 else 1
    stride_head = cache.stride(1) if cache.dim() == 3 else 0
    stride_angle = cos.stride(0) if cos.shape[0] > 1 else 0
    half = rotary_dim // 2
    _rotate_kernel[(slots.numel(), heads)](
        cache, slots.contiguous(), cos, sin, cache.stride(0), stride_head, stride_angle, col_offset,
        HALF=half, BLOCK_HALF=block(half), INTERLEAVED=interleaved)

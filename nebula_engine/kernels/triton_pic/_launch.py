"""Launch helpers shared by the kernels of this package (imported only once Triton is known to be there)."""

from __future__ import annotations

import torch
import triton

from nebula_engine.kernels.triton_pic import interpreting


def block(n: int, floor: int = 16) -> int:
    """A power-of-two block covering ``n``; ``tl.dot`` needs every dim >= 16 on the GPU."""
    return max(floor, triton.next_power_of_2(max(n, 1)))


def check_devices(*tensors: torch.Tensor) -> None:
    """Compiled kernels read device memory: every tensor must be on the same CUDA device."""
    if interpreting():
        return
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"compiled Triton kernels need tensors on one CUDA device, got {sorted(map(str, devices))}")


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether products run in fp32 (IEEE): for fp32 inputs, and always in the interpreter, whose bf16
    ``tl.dot`` is wrong (https://github.com/triton-lang/triton/issues/11584). Half-precision inputs on the GPU use tensor cores natively."""
    return interpreting() or dtype == torch.float32

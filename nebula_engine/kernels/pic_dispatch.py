"""One lookup for the PIC ops: the Triton kernel on a CUDA device when Triton works, else the torch reference.

Both have the signatures of ``kernels.pic_ops``; the choice is made per call from the tensors' device, so a CPU
machine never imports Triton here and a GPU machine uses the compiled kernels without configuration.
"""

from __future__ import annotations

import torch

from nebula_engine.kernels import pic_ops


def pic_op(name: str, device: torch.device | str):
    if torch.device(device).type == "cuda":
        from nebula_engine.kernels import triton_pic

        if triton_pic.triton_available():
            return getattr(triton_pic, name)
    return getattr(pic_ops, name)

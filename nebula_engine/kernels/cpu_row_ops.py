"""RMSNorm and rotary embedding in place, as one small C++ op each on CPU.

At a decode step's one row these ops are bound by dispatch, not arithmetic: ``F.rms_norm`` runs as eight aten ops
(7.8 us of CPU time on SmolLM2's 576 values, one thread) and ``apply_rotary`` of its 12 q and k heads as eight
(14.8 us); the ops here take 1.7 and 1.1 us (``cpu_row_ops.cpp``; the norm 2.7 us against 10.6 for F.rms_norm at 16
rows, 20 against 57 at 256). The rotation is bit for bit ``rotary.apply_rotary``; the norm differs from the torch
formula in the summation order of its mean only.

Compiled for this machine on first use (``-O3 -march=native``) into torch's extension cache, as ``cpu_paged_decode``.
Without a C++ compiler or ninja, or with ``NEBULA_CPU_KERNELS=0``, ``usable`` is False and callers take their torch
formulas.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from nebula_engine.kernels.cpp_build import build_and_load, cpu_flags_line, first_error_line

logger = logging.getLogger(__name__)

KERNELS_ENV = "NEBULA_CPU_KERNELS"
SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off"]
_LOCK = threading.Lock()
_LOADED: bool | None = None  # None: not tried yet
_ENABLED = os.environ.get(KERNELS_ENV, "1") != "0"


def _build_name() -> str:
    """The extension's name: its source, flags and this CPU's features (it is built with -march=native)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode())
    digest.update(cpu_flags_line().encode())
    return f"nebula_cpu_row_ops_{digest.hexdigest()[:12]}"


def load() -> bool:
    """Build (once per machine) and load the ops; True when ``torch.ops.nebula_rows`` is usable. A failure is logged
    once and False is returned from then on."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    with _LOCK:
        if _LOADED is not None:
            return _LOADED
        try:
            build_and_load(_build_name(), SOURCE, FLAGS)
            _LOADED = True
        except Exception as error:  # no compiler, no ninja, a read-only cache: the torch formulas still work
            logger.warning("CPU row ops unavailable, RMSNorm and RoPE use their torch formulas: %s",
                           first_error_line(error))
            _LOADED = False
    return _LOADED


def set_enabled(enabled: bool) -> bool:
    """Switch the ops on or off for this process (off: the torch formulas); returns the previous setting."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, bool(enabled)
    return previous


def usable(x: torch.Tensor) -> bool:
    """Whether ``x`` can take the ops: switched on, fp32 on CPU, outside autograd, ops loaded."""
    return (_ENABLED and x.dtype == torch.float32 and x.is_cpu and not torch.is_grad_enabled()
            and (_LOADED or (_LOADED is None and load())))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x²) + eps) * weight`` over the last dim of x [..., Hd] (contiguous), weight [Hd]."""
    return torch.ops.nebula_rows.rms_norm(x, weight, eps)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> None:
    """Rotate the leading ``r = 2 * cos.shape[-1]`` dims of every head of x [T, H, D] in place by cos/sin [T, r/2]
    (contiguous): pairs ``(i, i + r/2)``, or ``(2i, 2i + 1)`` when ``interleaved``. The heads may be a strided view
    (columns of a fused projection's output), each head's D values contiguous."""
    torch.ops.nebula_rows.rotate_(x, cos, sin, interleaved)

"""Decode attention on CPU over the paged K/V cache, read in place by a small C++ kernel.

The torch path (``paged_decode_reference``) first copies each sequence's context out of the pages, then SDPA reads
the copy: at 32 SmolLM2 sequences of ~150 tokens that is 18-20 ms of a 58 ms decode step, for 220 MB of K/V that
one pass could read in ~5 ms. The kernel (``cpu_paged_decode.cpp``) reads each page where it lies, prefetching the
next one, with an online softmax: 12 ms for the same 30 layers (``tools/bench_forward.py`` has the step's figures).

The kernel is compiled for this machine on first use (``-O3 -march=native``, ~8 s) by torch's ``cpp_extension``
into its extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and loaded from there
afterwards; processes that load it at once wait for one build. It runs on torch's own OpenMP pool
(``at::parallel_for``): a kernel from numba or a library built with its own ``-fopenmp`` brings a second OpenMP
runtime whose threads fight torch's (measured with a numba kernel: a prefill beside it took twice the CPU time). Without a
C++ compiler or ninja, or with ``NEBULA_CPU_KERNELS=0``, the torch path runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from nebula_engine.kernels.cpp_build import build_and_load, cpu_flags_line, first_error_line

logger = logging.getLogger(__name__)

KERNELS_ENV = "NEBULA_CPU_KERNELS"
SOURCE = Path(__file__).with_suffix(".cpp")
_LOCK = threading.Lock()
_LOADED: bool | None = None  # None: not tried yet
_ENABLED = os.environ.get(KERNELS_ENV, "1") != "0"


def _build_name() -> str:
    """The extension's name: its source and this CPU's features, since it is built with -march=native."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(cpu_flags_line().encode())
    return f"nebula_cpu_paged_decode_{digest.hexdigest()[:12]}"


def _build_and_load() -> None:
    build_and_load(_build_name(), SOURCE, ["-O3", "-march=native"])


def load() -> bool:
    """Build (once per machine) and load the kernel; True when ``torch.ops.nebula_cpu.paged_decode`` is usable.
    A failure is logged once and the torch path is used from then on."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    with _LOCK:
        if _LOADED is not None:
            return _LOADED
        try:
            _build_and_load()
            _LOADED = True
        except Exception as error:  # no compiler, no ninja, a read-only cache: the torch path still works
            logger.warning("CPU paged-decode kernel unavailable, decode attention uses the torch path: %s",
                           first_error_line(error))
            _LOADED = False
    return _LOADED


def set_enabled(enabled: bool) -> bool:
    """Switch the kernel on or off for this process (off: the torch path); returns the previous setting."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, bool(enabled)
    return previous


def usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether this call can take the kernel: switched on, fp32 tensors on CPU, outside autograd, kernel loaded."""
    # ``is_cpu``, not ``device.type``: a decode step asks once per layer, and building a device object costs more
    return (_ENABLED and q.is_cpu and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and v_cache.dtype == torch.float32 and k_cache.is_cpu
            and not (torch.is_grad_enabled() and q.requires_grad) and load())


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q [B, H, D]: one query token per sequence, attending to its first ``seq_lens[b]`` cached tokens (the last
    ``sliding_window`` of them when given), read through ``block_tables`` [B, max_pages] from k_cache [P, S, Hkv, D]
    / v_cache [P, S, Hkv, Dv]; -> [B, H, Dv]. Call only where ``usable`` says so; the kernel checks shapes, that
    each length is at least 1 and that every page it reads lies in the pool."""
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    torch.ops.nebula_cpu.paged_decode(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                                      block_tables.to(torch.int64).contiguous(), seq_lens.to(torch.int64).contiguous(),
                                      float(scale), int(sliding_window or 0), out)
    return out


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """The torch reference of ``paged_decode``: each sequence's context copied out of its pages, then SDPA."""
    page_size, out = k_cache.shape[1], []
    for b, length in enumerate(seq_lens.tolist()):
        first = max(0, length - sliding_window) if sliding_window else 0
        pages = block_tables[b, : -(-length // page_size)]
        keys = k_cache.index_select(0, pages).flatten(0, 1)[first:length].transpose(0, 1)  # [Hkv, L, D]
        values = v_cache.index_select(0, pages).flatten(0, 1)[first:length].transpose(0, 1)
        attended = F.scaled_dot_product_attention(q[b][:, None], keys, values, scale=scale,
                                                  enable_gqa=keys.shape[0] != q.shape[1])
        out.append(attended[:, 0])
    return torch.stack(out)

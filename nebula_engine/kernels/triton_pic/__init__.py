"""Triton kernels of the PIC ops, with the signatures of their torch references in ``kernels.pic_ops``.

- ``rotate_cached_keys``, ``kv_deviation``, ``scattered_paged_attention``: as in ``pic_ops``.
- ``chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size=64) -> (o, final_state)``: as in
  ``kernels.gated_delta_rule``; ``gated_delta_transition`` runs it in transition mode (v = 0, S_0 = I).
- ``select_top_tokens`` is the torch one (a sort; no kernel needed).

Triton is optional: this package imports without it. A kernel is looked up on first access, and only then
is Triton imported; if ``triton_available()`` is false that access raises RuntimeError saying why.
Kernels run compiled on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set it before the
first kernel access: ``triton.jit`` reads it when a kernel module is imported).
"""

from __future__ import annotations

import importlib
import os

import torch

from nebula_engine.kernels.pic_ops import select_top_tokens

__all__ = ["triton_available", "interpreting", "select_top_tokens", "rotate_cached_keys", "kv_deviation",
           "scattered_paged_attention", "chunk_gated_delta_rule", "gated_delta_transition"]

_KERNEL_MODULES = {
    "rotate_cached_keys": "rotate",
    "kv_deviation": "deviation",
    "scattered_paged_attention": "scattered_attention",
    "chunk_gated_delta_rule": "gated_delta",
    "gated_delta_transition": "gated_delta",
}


def interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    """True when ``import triton`` works and kernels can run: on a CUDA device or in the interpreter."""
    return _triton_import_error() is None and (torch.cuda.is_available() or interpreting())


def _triton_import_error() -> str | None:
    try:
        importlib.import_module("triton")
    except ImportError as error:  # a capability probe: callers get the reason from _require_triton
        return str(error)
    return None


def _require_triton() -> None:
    error = _triton_import_error()
    if error is not None:
        raise RuntimeError(f"Triton kernels need the 'triton' package ({error}); pip install 'nebula-engine[gpu]' "
                           "or use the torch references in nebula_engine.kernels.pic_ops")
    if not triton_available():
        raise RuntimeError("Triton kernels need a CUDA device or TRITON_INTERPRET=1 (CPU interpreter); "
                           "use the torch references in nebula_engine.kernels.pic_ops instead")


def __getattr__(name: str):
    if name in _KERNEL_MODULES:
        _require_triton()
        module = importlib.import_module(f"{__name__}.{_KERNEL_MODULES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

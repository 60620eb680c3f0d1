"""fp32 linear layers on CPU through oneDNN, with each weight packed once into oneDNN's blocked layout.

``F.linear`` on CPU calls MKL's sgemm. At the few rows of a decode step oneDNN with a packed weight is much
faster on the machines we run: SmolLM2's linear weights take 262 ms a step at 32 rows through ``F.linear`` and
150 ms packed (1.4x at 1 and 8 rows, 1.1x at 512; MKL's own packed sgemm gained 7%); 2 threads, AMD EPYC,
``tools/bench_linear.py``. torch.compile's CPU path packs weights the same way (``mkldnn._reorder_linear_weight``).

The packed copy is built by ``prepack`` when the model is loaded (else on first use) and kept beside the weight
(a second copy of every linear weight in memory). It is rebuilt when the weight changes in place (its version
counter moves) and dropped with the weight. Anything else (autograd, other devices or dtypes, weights made under
``inference_mode``, no oneDNN) takes ``F.linear``, and so does everything when the environment sets
``NEBULA_CPU_PREPACK=0`` (to save the memory of the copies).

A weight may also be a ``QuantizedWeight`` (GGUF blocks, ``quant_linear``): ``linear`` then runs the fused
dequantize-and-multiply kernel, and ``Linear.use_quantized_weight`` puts one in place of a module's fp32 parameter.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from nebula_engine.kernels.quant_linear import (AnyQuantizedWeight, QuantizedWeight, StackedQuantizedWeight,
                                                 quantized_linear)

PREPACK_ENV = "NEBULA_CPU_PREPACK"
_ENABLED = torch.backends.mkldnn.is_available() and os.environ.get(PREPACK_ENV, "1") != "0"
_LOCK = threading.Lock()
# weight -> (its version and data pointer when packed, the packed copy)
_PACKED = WeakIdKeyDictionary()


def set_prepacking(enabled: bool) -> bool:
    """Switch packed CPU linears on or off for this process (off: ``F.linear`` everywhere, no second copy of
    the weights kept from now on); returns the previous setting."""
    global _ENABLED
    previous = _ENABLED
    _ENABLED = bool(enabled) and torch.backends.mkldnn.is_available()
    if not _ENABLED:
        with _LOCK:
            _PACKED.clear()
    return previous


def prepacking_enabled() -> bool:
    return _ENABLED


def _packs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # a weight made under inference_mode has no version counter, so a stale copy could not be noticed
    return (_ENABLED and not torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype == torch.float32
            and _packable(weight))


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of ``weight`` [out, in], current with its values."""
    key = (weight._version, weight.data_ptr())
    entry = _PACKED.get(weight)
    if entry is not None and entry[0] == key:
        return entry[1]
    with _LOCK:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        _PACKED[weight] = (key, packed)
    return packed


def _packable(weight: torch.Tensor | AnyQuantizedWeight) -> bool:
    return (isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2 and not weight.is_inference())


def prepack(module: nn.Module) -> int:
    """Pack now every weight ``module``'s forward hands to ``linear``: each submodule's ``linear_weights()``.

    Packing is a load-time transform of the weights, as vLLM's ``process_weights_after_loading``: done lazily,
    a server's first request paid for it (a random 4-layer Qwen3 with a 151,936-token LM head, one thread:
    TTFT 0.32 s instead of 0.04 s). Returns the number of weights packed."""
    if not _ENABLED:
        return 0
    count = 0
    with torch.no_grad():
        for sub in module.modules():
            for weight in getattr(sub, "linear_weights", tuple)():
                if _packable(weight):
                    packed_weight(weight)
                    count += 1
    return count


def linear(x: torch.Tensor, weight: torch.Tensor | AnyQuantizedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., in], weight [out, in] (fp32 or quantized), bias [out] -> [..., out]."""
    if isinstance(weight, (QuantizedWeight, StackedQuantizedWeight)):
        return quantized_linear(x, weight, bias)
    if not _packs(x, weight):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(weight), bias, "none", [], "")


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose forward takes the packed CPU path when it can."""

    fused = False  # its weight is a slice of a fused one (``FusedProjections``): the forward does not use it

    def linear_weights(self) -> tuple[torch.Tensor | AnyQuantizedWeight, ...]:
        """The weights this module's forward passes to ``linear`` (what ``prepack`` packs)."""
        return () if self.fused else (self.weight,)

    def use_quantized_weight(self, weight: QuantizedWeight) -> None:
        """Compute with ``weight``'s blocks from now on; the fp32 ``weight`` parameter is dropped (it leaves the
        module's parameters and state dict: the blocks are not a parameter)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"a quantized weight {list(weight.shape)} cannot replace a "
                             f"[{self.out_features}, {self.in_features}] linear weight")
        del self.weight
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

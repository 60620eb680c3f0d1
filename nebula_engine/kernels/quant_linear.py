"""Linear layers over weights kept in llama.cpp's GGUF block formats, computed by a fused dequantize-and-multiply
CPU kernel (``cpu_quant_matmul.cpp``).

A decode step's speed is bound by the bytes of weights it reads: Q4_1 reads 20 bytes per 32 weights, fp32 128. The
kernel dequantizes each block in registers, exactly as ``gguf.quants.dequantize`` does, and multiplies it into fp32
activations with fp32 accumulation: the output is the fp32 linear of the dequantized weight up to summation order
(llama.cpp instead rounds the activations to int8, which this does not). Few rows stream every block once into all
of them; from ``GEMM_MIN_ROWS`` rows on, panels of ``PANEL_ROWS`` weight rows are dequantized to an fp32 tile that
torch's GEMM multiplies. ``tools/bench_quant_linear.py`` measures both against fp32 ``F.linear``.

The kernel is compiled on first use by torch's ``cpp_extension`` into its extension cache (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``), with AVX2/FMA/F16C and AVX-512 where this CPU has them, else as portable C++. It runs
on torch's own OpenMP pool (``at::parallel_for``, ``torch.get_num_threads()`` threads). Without a C++ compiler or
ninja, or with ``NEBULA_CPU_KERNELS=0``, ``load()`` is False and the GGUF loader dequantizes at load instead. Only
CPU: on other devices the weights are dequantized at load.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from nebula_engine.kernels.cpp_build import build_and_load, cpu_flags_line, first_error_line

logger = logging.getLogger(__name__)

KERNELS_ENV = "NEBULA_CPU_KERNELS"
SOURCE = Path(__file__).parent / "cpu_quant_matmul.cpp"
# From this many rows of x on, the panel GEMM instead of the streaming GEMV. Measured with
# ``tools/bench_quant_linear.py --sweep-rows`` (2 threads, AMD EPYC, weights walked cold): the GEMV/GEMM time ratio
# crosses 1 at 64-96 rows for SmolLM2's shapes (K 576, 1536) and at 16-32 for Qwen2.5-0.5B's MLP (K 4864 down,
# N 4864 gate/up); over the nine shapes its geometric mean is 0.87 at 32 rows and 1.03 at 48.
GEMM_MIN_ROWS = 48
# Weight rows dequantized per GEMM tile: at 512 rows of x SmolLM2's four shapes took 3.99/2.40/6.26/5.98 ms with
# 64-row panels, 3.39/2.04/5.16/5.33 ms with 512 and up to 2.5x longer with 4096 (``--sweep-panels``, 2 threads).
PANEL_ROWS = 512

# ggml type id -> (values per block, bytes per block), the types the kernel reads (gguf.GGML_QUANT_SIZES)
BLOCK_LAYOUTS = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    30: (1, 2),  # BF16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
}
F32 = 0
_CHUNK = 32  # the kernel reads every type 32 values at a time

_LOCK = threading.Lock()
_LOADED: bool | None = None  # None: not tried yet
_ENABLED = os.environ.get(KERNELS_ENV, "1") != "0"
# the kernel's paths by instruction set, in the order of the C++ ``Isa`` ids: a build has a prefix of them
INSTRUCTION_SETS = ("portable", "avx2", "avx512")
_ISA: int | None = None  # None: the best the build has
_BUILT_ISA = 0  # the best path of the loaded build (read once at load, not on every call)
_KERNEL = None  # the loaded ops (``torch.ops.nebula_quant``), looked up once


def computes(qtype: int, in_features: int) -> bool:
    """Whether the kernel reads rows of ``in_features`` values stored as ggml type ``qtype``."""
    layout = BLOCK_LAYOUTS.get(int(qtype))
    return layout is not None and in_features % _CHUNK == 0 and in_features % layout[0] == 0


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A weight W [N, K] in one ggml block format: ``data`` [N, row bytes] uint8 holds each row's blocks as ggml
    lays them out (read from a GGUF file it is a view of the file's read-only mapping: never write to it)."""

    data: torch.Tensor
    qtype: int  # a ggml type id (gguf.GGMLQuantizationType)
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if not computes(self.qtype, cols):
            raise ValueError(f"ggml type {int(self.qtype)} with rows of {cols} values is not computed by the quantized "
                             f"linear kernel")
        values, nbytes = BLOCK_LAYOUTS[int(self.qtype)]
        if (self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.device.type != "cpu"
                or tuple(self.data.shape) != (rows, cols // values * nbytes)):
            raise ValueError(f"blocks of a [{rows}, {cols}] weight of ggml type {int(self.qtype)} must be a uint8 CPU "
                             f"tensor [{rows}, {cols // values * nbytes}], got {self.data.dtype} "
                             f"{list(self.data.shape)}")

    @classmethod
    def from_numpy(cls, blocks: np.ndarray, qtype: int, shape: tuple[int, int]) -> QuantizedWeight:
        """Blocks [N, row bytes] without a copy: a read-only array (a mapped file) stays shared with the file."""
        with warnings.catch_warnings():  # torch warns that it cannot mark the tensor read-only; nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(blocks))
        return cls(data, int(qtype), (int(shape[0]), int(shape[1])))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> QuantizedWeight:
        """An fp32 weight [N, K] as F32 "blocks": its own bytes, not copied when contiguous."""
        weight = weight.detach().contiguous()
        return cls(weight.view(torch.uint8), F32, (weight.shape[0], weight.shape[1]))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @cached_property
    def kernel_operands(self) -> tuple[list[torch.Tensor], list[int]]:
        """The kernel's ``parts`` and ``qtypes`` arguments, built once (a decode step passes them ~150 times)."""
        return [self.data], [int(self.qtype)]

    def dequantize(self) -> torch.Tensor:
        """W as fp32 [N, K], by ``gguf.quants.dequantize`` (the reference the kernel is tested against)."""
        from gguf.quants import dequantize

        values = dequantize(self.data.numpy(), self.qtype)
        return torch.from_numpy(np.require(values, np.float32, "CW")).reshape(self.shape)


@dataclass(frozen=True, eq=False)
class StackedQuantizedWeight:
    """W [N_1 + N_2 + ..., K]: weights stacked row-wise (a fused q/k/v projection), each in its own format, read
    in place: one kernel call computes every part's columns of the output."""

    parts: tuple[QuantizedWeight, ...]

    def __post_init__(self) -> None:
        if not self.parts or len({part.shape[1] for part in self.parts}) != 1:
            raise ValueError("stacked weights need at least one part, all with the same in-features")

    @cached_property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @cached_property
    def kernel_operands(self) -> tuple[list[torch.Tensor], list[int]]:
        """As ``QuantizedWeight.kernel_operands``: every part's blocks and type, in row order."""
        return [part.data for part in self.parts], [int(part.qtype) for part in self.parts]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])


AnyQuantizedWeight = QuantizedWeight | StackedQuantizedWeight


def _simd_flags() -> list[str]:
    """SIMD code only for a CPU that runs it: the flags from /proc/cpuinfo, else torch's own CPU check."""
    flags = set(cpu_flags_line().partition(":")[2].split())
    if flags:
        has_avx2 = {"avx2", "fma", "f16c"} <= flags
        has_avx512 = has_avx2 and {"avx512f", "avx512bw", "avx512vl"} <= flags
    else:
        capability = torch.backends.cpu.get_cpu_capability()
        has_avx2, has_avx512 = capability in ("AVX2", "AVX512"), capability == "AVX512"
    return (["-mavx2", "-mfma", "-mf16c"] if has_avx2 else []) + (
        ["-mavx512f", "-mavx512bw", "-mavx512vl"] if has_avx512 else [])


def _build_and_load() -> None:
    """Into a folder named by the source and flags (``kernels.cpp_build``)."""
    flags = ["-O3", *_simd_flags()]
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    build_and_load(f"nebula_cpu_quant_matmul_{digest}", SOURCE, flags)


def load() -> bool:
    """Build (once per machine) and load the kernel; True when ``torch.ops.nebula_quant`` is usable. A failure (or
    ``NEBULA_CPU_KERNELS=0``) is logged once and False is returned from then on."""
    global _LOADED, _BUILT_ISA, _KERNEL
    if _LOADED is not None:
        return _LOADED
    with _LOCK:
        if _LOADED is not None:
            return _LOADED
        if not _ENABLED:
            _LOADED = False
            return _LOADED
        try:
            _build_and_load()
            _KERNEL = torch.ops.nebula_quant
            _BUILT_ISA = int(_KERNEL.isa())
            _LOADED = True
        except Exception as error:  # no compiler, no ninja, a read-only cache: weights are dequantized at load
            logger.warning("CPU quantized-linear kernel unavailable, GGUF weights are dequantized at load: %s",
                           first_error_line(error))
            _LOADED = False
    return _LOADED


def instruction_sets() -> tuple[str, ...]:
    """The paths the loaded kernel has, portable first and best last (empty when it did not load)."""
    return INSTRUCTION_SETS[:_BUILT_ISA + 1] if load() else ()


def set_instruction_set(name: str | None) -> str | None:
    """Force one path of the kernel (a name of ``instruction_sets()``), or let the build pick its best (None);
    returns the previous setting. The slower paths are there for CPUs without the faster ones, and for tests."""
    global _ISA
    if name is not None and name not in instruction_sets():
        raise RuntimeError(f"the quantized-linear kernel has no {name!r} path on this CPU; it has "
                           f"{', '.join(instruction_sets()) or 'none (it did not load)'}")
    previous = None if _ISA is None else INSTRUCTION_SETS[_ISA]
    _ISA = None if name is None else INSTRUCTION_SETS.index(name)
    return previous


def quantized_linear(x: torch.Tensor, weight: AnyQuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight.dequantize(), bias)``: x [..., K] fp32, weight [N, K], bias [N] -> [..., N].

    Autograd (x requiring grad) and a kernel that did not load take that torch path, dequantizing the whole weight
    on each call. A decode step makes ~150 of these calls, so the checks are the cheap ones (``is_cpu``, not
    ``device.type``) and a 2-d x gets the kernel's output as is."""
    if not (x.is_cpu and x.dtype == torch.float32) or (x.requires_grad and torch.is_grad_enabled()) or not load():
        return quantized_linear_reference(x, weight, bias)
    out_features, in_features = weight.shape
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, in_features).contiguous()
    out = rows.new_empty(rows.shape[0], out_features)
    blocks, qtypes = weight.kernel_operands
    _KERNEL.linear(rows, blocks, qtypes, None if bias is None else bias.detach().contiguous(), GEMM_MIN_ROWS,
                   PANEL_ROWS, _BUILT_ISA if _ISA is None else _ISA, out)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def quantized_linear_reference(x: torch.Tensor, weight: AnyQuantizedWeight,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: the weight dequantized by ``gguf.quants.dequantize``, then ``F.linear``."""
    return F.linear(x, weight.dequantize().to(x.device, x.dtype), bias)


def dequantize_rows(weight: QuantizedWeight, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices`` (any shape, int64) of ``weight`` dequantized: fp32 [*indices.shape, K] (an embedding
    lookup into a table kept in its blocks). Reads only those rows' blocks."""
    flat = indices.reshape(-1)
    rows = weight.data.index_select(0, flat)
    if not load():
        picked = QuantizedWeight(rows, weight.qtype, (flat.numel(), weight.shape[1]))
        return picked.dequantize().view(*indices.shape, weight.shape[1])
    out = torch.empty(flat.numel(), weight.shape[1])
    _KERNEL.dequantize(rows, int(weight.qtype), _BUILT_ISA if _ISA is None else _ISA, out)
    return out.view(*indices.shape, weight.shape[1])


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """``weight.dequantize()`` by the kernel's own dequantizer (the one its GEMM path uses): fp32 [N, K]."""
    if not load():
        return weight.dequantize()
    out = torch.empty(weight.shape)
    torch.ops.nebula_quant.dequantize(weight.data, int(weight.qtype), _BUILT_ISA if _ISA is None else _ISA, out)
    return out

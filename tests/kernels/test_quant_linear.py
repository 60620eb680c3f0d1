"""The quantized-linear CPU kernel against its referee, ``gguf.quants.dequantize`` then an fp32 matmul: every block
type, random blocks, every path the CPU runs (portable, AVX2, AVX-512), the streaming GEMV and the panel GEMM,
stacked parts."""

import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nebula_engine.kernels import quant_linear
from nebula_engine.kernels.quant_linear import QuantizedWeight, StackedQuantizedWeight, quantized_linear

gguf = pytest.importorskip("gguf", reason="the quantized-linear tests need the 'gguf' extra")
Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel with")

BLOCK_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# byte offsets of each block's fp16 scales (d, and the min or dmin where the type has one)
SCALE_OFFSETS = {Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q8_0: (0,), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2),
                 Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
PATHS = list(quant_linear.INSTRUCTION_SETS)


@pytest.fixture(scope="module", autouse=True)
def kernel_loaded():
    assert quant_linear.load(), "the kernel did not build on a machine with a C++ compiler (see the log)"


@pytest.fixture(params=PATHS)
def kernel_path(request):
    if request.param not in quant_linear.instruction_sets():
        pytest.skip(f"this CPU has no {request.param} path")
    previous = quant_linear.set_instruction_set(request.param)
    yield request.param
    quant_linear.set_instruction_set(previous)


def random_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, row bytes]: random quants (every bit pattern), fp16 scales of either sign near 1e-2; float types
    hold random normal values."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if qtype == Q.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
        return values.astype(np.float16 if qtype == Q.F16 else np.float32).view(np.uint8).reshape(rows, -1)
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(5e-3, 2e-2, blocks.shape[0]) * rng.choice([-1, 1], blocks.shape[0])
        blocks[:, offset:offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def weight_of(qtype, rows: int, cols: int, seed: int) -> QuantizedWeight:
    return QuantizedWeight.from_numpy(random_blocks(qtype, rows, cols, seed), qtype, (rows, cols))


def reference(x: torch.Tensor, weight, bias=None) -> torch.Tensor:
    """x @ W.T in fp64 from the referee's dequantized W."""
    dense = weight.dequantize().double()
    out = x.double() @ dense.T
    return out if bias is None else out + bias.double()


def assert_matches(out: torch.Tensor, x: torch.Tensor, weight, bias=None) -> None:
    """Within 1e-5 of the magnitude the sum is made of (|x| @ |W|.T): fp32 accumulation in another order."""
    expected = reference(x, weight, bias)
    magnitude = x.abs().double() @ weight.dequantize().abs().double().T + (0 if bias is None else bias.abs().double())
    assert out.dtype == torch.float32 and out.shape == expected.shape
    excess = (out.double() - expected).abs() - 1e-5 * magnitude - 1e-30
    assert (excess <= 0).all(), f"worst error beyond tolerance: {excess.max().item():.3g}"


def k_for(qtype, multiple: int) -> int:
    return multiple * (256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_kernel_dequantizes_exactly_as_the_referee(qtype, kernel_path):
    weight = weight_of(qtype, 7, k_for(qtype, 3), seed=int(qtype))
    assert torch.equal(quant_linear.dequantize(weight), weight.dequantize())


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_looked_up_rows_are_the_referees_rows(qtype, kernel_path):
    """An embedding lookup into blocks: rows in any order and shape, repeats included; an id out of range raises."""
    weight = weight_of(qtype, 11, k_for(qtype, 2), seed=int(qtype) + 100)
    ids = torch.tensor([[3, 0, 10], [3, 7, 7]])
    rows = quant_linear.dequantize_rows(weight, ids)
    assert rows.shape == (2, 3, weight.shape[1])
    assert torch.equal(rows, weight.dequantize()[ids])
    assert quant_linear.dequantize_rows(weight, torch.tensor([], dtype=torch.long)).shape == (0, weight.shape[1])
    with pytest.raises(IndexError):
        quant_linear.dequantize_rows(weight, torch.tensor([11]))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, quant_linear.GEMM_MIN_ROWS + 12), multiple=st.integers(1, 3),
       out_features=st.integers(1, 37), with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_random_blocks_match_the_referee(qtype, kernel_path, rows, multiple, out_features, with_bias, seed):
    """Rows from 1 to past GEMM_MIN_ROWS cover the GEMV's tiles of 16/8/4/2/1 rows and the panel-GEMM path."""
    in_features = k_for(qtype, multiple)
    weight = weight_of(qtype, out_features, in_features, seed)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    with torch.inference_mode():
        assert_matches(quantized_linear(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 5, quant_linear.GEMM_MIN_ROWS + 3])
def test_blocks_quantized_by_gguf_match_the_referee(qtype, rows, kernel_path):
    """Blocks as llama.cpp's quantizer writes them (gguf's port of it), not only random bytes."""
    values = np.random.default_rng(rows).standard_normal((24, 96)).astype(np.float32)
    weight = QuantizedWeight.from_numpy(gguf.quants.quantize(values, qtype), qtype, values.shape)
    x = torch.randn(rows, 96)
    with torch.no_grad():
        assert_matches(quantized_linear(x, weight), x, weight)


@pytest.mark.parametrize("rows", [1, 3, 9, quant_linear.GEMM_MIN_ROWS, 70])
def test_stacked_parts_of_different_types_fill_their_own_columns(rows, kernel_path):
    parts = (weight_of(Q.Q5_0, 12, 256, 1), weight_of(Q.Q8_0, 5, 256, 2), weight_of(Q.Q6_K, 9, 256, 3),
             QuantizedWeight.from_float(torch.randn(4, 256)))
    stacked = StackedQuantizedWeight(parts)
    x, bias = torch.randn(rows, 256), torch.randn(30)
    assert stacked.shape == (30, 256) and stacked.nbytes == sum(p.nbytes for p in parts)
    with torch.no_grad():
        assert_matches(quantized_linear(x, stacked, bias), x, stacked, bias)


def test_panels_shorter_than_the_weight_and_leading_dims(monkeypatch):
    """More W rows than one panel holds (the GEMM path loops over panels); x [..., K] of any leading shape,
    strided; no rows at all."""
    monkeypatch.setattr(quant_linear, "PANEL_ROWS", 16)
    weight = weight_of(Q.Q4_K, 50, 512, 4)
    x = torch.randn(512, 2 * quant_linear.GEMM_MIN_ROWS).t()  # [2*GEMM_MIN_ROWS, 512], not contiguous
    with torch.no_grad():
        assert_matches(quantized_linear(x, weight), x, weight)
        batched = torch.randn(2, 3, 512)
        torch.testing.assert_close(quantized_linear(batched, weight),
                                   quantized_linear(batched.reshape(6, 512), weight).view(2, 3, 50))
        assert quantized_linear(torch.randn(0, 512), weight).shape == (0, 50)


def test_autograd_takes_the_reference_path():
    weight = weight_of(Q.Q8_0, 6, 64, 5)
    x = torch.randn(3, 64, requires_grad=True)
    quantized_linear(x, weight).sum().backward()
    torch.testing.assert_close(x.grad, weight.dequantize().sum(0).expand(3, 64))


def test_blocks_are_not_copied_and_bad_shapes_are_named():
    blocks = random_blocks(Q.Q4_0, 4, 64, 6)
    blocks.flags.writeable = False  # as a read-only mapped file gives them
    weight = QuantizedWeight.from_numpy(blocks, Q.Q4_0, (4, 64))
    assert weight.data.data_ptr() == blocks.ctypes.data and weight.nbytes == blocks.nbytes == 4 * 2 * 18
    assert weight.numel() == 256
    with pytest.raises(ValueError, match=r"must be a uint8 CPU tensor \[4, 36\], got torch.uint8 \[4, 35\]"):
        QuantizedWeight(weight.data[:, :35], Q.Q4_0, (4, 64))
    with pytest.raises(ValueError, match="rows of 48 values is not computed"):
        QuantizedWeight(torch.zeros(4, 27, dtype=torch.uint8), Q.Q4_0, (4, 48))
    with pytest.raises(ValueError, match="rows of 256 values is not computed"):
        QuantizedWeight(torch.zeros(1, 66, dtype=torch.uint8), Q.Q2_K, (1, 256))
    with pytest.raises(ValueError, match="same in-features"):
        StackedQuantizedWeight((weight, weight_of(Q.Q4_0, 4, 96, 7)))
    with pytest.raises(RuntimeError, match="x must be a contiguous fp32 CPU tensor"):
        torch.ops.nebula_quant.linear(torch.randn(2, 64, dtype=torch.float64), [weight.data], [int(Q.Q4_0)], None,
                                      16, 256, False, torch.empty(2, 4))
    with pytest.raises(RuntimeError, match="has 36 bytes a row, K = 96 needs 54"):
        torch.ops.nebula_quant.linear(torch.randn(2, 96), [weight.data], [int(Q.Q4_0)], None, 16, 256, False,
                                      torch.empty(2, 4))


def test_computes_names_what_the_kernel_reads():
    assert quant_linear.computes(Q.Q4_K, 512) and quant_linear.computes(Q.F16, 64)
    assert not quant_linear.computes(Q.Q4_K, 96)  # rows must be whole blocks
    assert not quant_linear.computes(Q.F16, 40)  # the kernel reads 32 values at a time
    assert not quant_linear.computes(Q.Q2_K, 256) and not quant_linear.computes(Q.IQ4_NL, 256)

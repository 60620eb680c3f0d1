"""GatedMLP over GGUF blocks: gate and up read by one kernel call over their stacked rows, the same output as two."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from nebula_engine.kernels import quant_linear
from nebula_engine.kernels.cpu_linear import linear
from nebula_engine.kernels.quant_linear import QuantizedWeight, StackedQuantizedWeight
from nebula_engine.model.layers import GatedMLP

gguf = pytest.importorskip("gguf", reason="GGUF blocks need the 'gguf' extra")
Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel with")

HIDDEN, WIDTH = 256, 96


def _blocks(qtype, rows: int, cols: int, seed: int) -> QuantizedWeight:
    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy() * 0.1
    return QuantizedWeight.from_numpy(gguf.quants.quantize(values, qtype), qtype, values.shape)


def _mlp_with_blocks(gate_type, up_type, bias: bool) -> GatedMLP:
    """What the GGUF loader does: each projection takes its blocks, then the module refuses."""
    mlp = GatedMLP(HIDDEN, WIDTH, bias=bias)
    mlp.gate_proj.use_quantized_weight(_blocks(gate_type, WIDTH, HIDDEN, seed=1))
    mlp.up_proj.use_quantized_weight(_blocks(up_type, WIDTH, HIDDEN, seed=2))
    mlp.down_proj.use_quantized_weight(_blocks(Q.Q8_0, HIDDEN, WIDTH, seed=3))
    if bias:
        with torch.no_grad():
            for child in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                child.bias.copy_(torch.randn(child.bias.shape))
    mlp.refuse()
    return mlp


def _two_calls(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    gate = linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
    up = linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
    return mlp.down_proj(F.silu(gate) * up)


@pytest.fixture(scope="module", autouse=True)
def kernel_loaded():
    assert quant_linear.load(), "the kernel did not build on a machine with a C++ compiler (see the log)"


@pytest.mark.parametrize("rows", [1, 5, 64])  # 64: the panel GEMM path
@pytest.mark.parametrize("gate_type,up_type,bias", [(Q.Q4_1, Q.Q4_1, False), (Q.Q8_0, Q.Q8_0, True),
                                                     (Q.Q4_0, Q.Q5_1, False)])
def test_stacked_gate_and_up_give_the_output_of_two_calls(rows, gate_type, up_type, bias):
    torch.manual_seed(rows)
    mlp = _mlp_with_blocks(gate_type, up_type, bias)
    assert isinstance(mlp.gate_up_weight, StackedQuantizedWeight)
    assert mlp.linear_weights() == (mlp.gate_up_weight,) and mlp.gate_proj.linear_weights() == ()
    x = torch.randn(rows, HIDDEN)
    with torch.no_grad():
        assert torch.equal(mlp(x), _two_calls(mlp, x))


def test_fp32_projections_stay_two_matmuls():
    mlp = GatedMLP(HIDDEN, WIDTH)
    mlp.refuse()
    assert mlp.gate_up_weight is None and mlp.gate_proj.linear_weights() == (mlp.gate_proj.weight,)
    x = torch.randn(3, HIDDEN)
    torch.testing.assert_close(mlp(x), mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))


def test_loaded_bias_values_reach_the_stacked_call():
    """The children's biases become slices of the stacked bias: a value loaded into one after stacking counts."""
    mlp = _mlp_with_blocks(Q.Q8_0, Q.Q8_0, bias=True)
    with torch.no_grad():
        mlp.up_proj.bias.add_(1.0)
        x = torch.randn(2, HIDDEN)
        assert torch.equal(mlp(x), _two_calls(mlp, x))

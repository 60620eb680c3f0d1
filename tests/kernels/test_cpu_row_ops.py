"""The CPU row ops (RMSNorm, rotary in place) against their torch formulas, over shapes that
do and do not fill the ops' 16-value lanes, one row and many (split over threads)."""

import shutil

import pytest
import torch

from nebula_engine.kernels import cpu_row_ops
from nebula_engine.model.layers import RMSNorm
from nebula_engine.model.rotary import apply_rotary

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the ops with")

ROWS = [1, 3, 64, 513]
WIDTHS = [8, 13, 576, 896]


@pytest.fixture(scope="module", autouse=True)
def ops_loaded():
    assert cpu_row_ops.load(), "the row ops did not build on a machine with a C++ compiler (see the log)"


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` in fp32."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _data(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_matches_the_hf_formula(rows, width, threads):
    x, weight = _data(rows, width, seed=rows * width), _data(width, seed=1)
    out = cpu_row_ops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, _hf_rms_norm(x, weight, 1e-6), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [(2, 3, 13), (4, 1, 576), (0, 8)])
def test_rms_norm_normalizes_the_last_dim_of_any_leading_shape(shape):
    x, weight = _data(*shape, seed=4), _data(shape[-1], seed=5)
    out = cpu_row_ops.rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape
    torch.testing.assert_close(out, _hf_rms_norm(x, weight, 1e-6), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,head_dim,rotary_dim", [(1, 8, 8), (12, 64, 64), (5, 32, 16), (3, 24, 10)])
def test_rotation_in_place_is_apply_rotary_bit_for_bit(style, rows, heads, head_dim, rotary_dim, threads):
    x = _data(rows, heads, head_dim, seed=heads * rows)
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * _data(rotary_dim // 2, seed=3).abs()[None, :]
    cos, sin = angles.cos(), angles.sin()
    expected = apply_rotary(x, cos, sin, style)
    cpu_row_ops.rotate_(x, cos, sin, interleaved=style == "interleaved")
    assert torch.equal(x, expected)


def test_rotation_of_a_strided_view_touches_only_its_columns():
    """q and k heads as columns of a fused projection's output [T, (H + Hkv) * D + Hkv * D]: v stays as it was."""
    tokens, heads, dim = 4, 6, 16
    fused = _data(tokens, (heads + 2) * dim, seed=5)
    angles = _data(tokens, dim // 2, seed=6)
    view = fused[:, : heads * dim].view(tokens, heads, dim)
    expected = apply_rotary(view, angles.cos(), angles.sin(), "neox")
    untouched = fused[:, heads * dim:].clone()
    cpu_row_ops.rotate_(view, angles.cos(), angles.sin(), interleaved=False)
    assert torch.equal(fused[:, : heads * dim].view(tokens, heads, dim), expected)
    assert torch.equal(fused[:, heads * dim:], untouched)


def test_inputs_the_ops_do_not_take_are_refused():
    weight = torch.ones(8)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_row_ops.rms_norm(torch.ones(2, 8, dtype=torch.float64), weight, 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_row_ops.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="rotary dims"):
        cpu_row_ops.rotate_(torch.ones(2, 1, 8), torch.ones(2, 5), torch.ones(2, 5), False)


@pytest.mark.parametrize("shape", [(1, 32), (7, 32), (3, 4, 32)])
def test_rms_norm_module_gives_the_same_with_and_without_the_op(shape):
    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(_data(32, seed=7))
        x = _data(*shape, seed=8)
        with_op = norm(x)
        previous = cpu_row_ops.set_enabled(False)
        try:
            without = norm(x)
        finally:
            cpu_row_ops.set_enabled(previous)
    torch.testing.assert_close(with_op, without, atol=1e-6, rtol=1e-6)

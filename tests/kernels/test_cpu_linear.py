"""Packed oneDNN linears against ``F.linear``, the torch reference."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nebula_engine.kernels import cpu_linear
from nebula_engine.kernels.cpu_linear import Linear, linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture(autouse=True)
def prepacking_on():
    previous = cpu_linear.set_prepacking(True)
    yield
    cpu_linear.set_prepacking(previous)


@pytest.mark.parametrize("rows", [0, 1, 7, 32, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(rows, 80, generator=generator)
    with torch.inference_mode():
        out = linear(x, weight, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_leading_dims_and_strided_input():
    weight = torch.randn(48, 64)
    x = torch.randn(3, 5, 64)
    strided = torch.randn(64, 9).t()  # [9, 64], not contiguous
    with torch.no_grad():
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(strided, weight), F.linear(strided, weight), rtol=1e-5, atol=1e-5)


def test_weight_changed_in_place_is_repacked():
    weight, x = torch.randn(16, 32), torch.randn(4, 32)
    with torch.no_grad():
        first = linear(x, weight)
        weight.mul_(2)  # e.g. checkpoint weights copied into a slice of a fused weight after a first forward
        torch.testing.assert_close(linear(x, weight), 2 * first, rtol=1e-5, atol=1e-5)


def test_a_fused_weight_sees_its_slices_loaded():
    fused = torch.zeros(8, 4)
    q_slice = nn.Parameter(fused[:4])  # a child's parameter as ``fuse_linear_weights`` makes it
    x = torch.randn(2, 4)
    with torch.no_grad():
        linear(x, fused)
        q_slice.copy_(torch.ones(4, 4))
        torch.testing.assert_close(linear(x, fused)[:, :4], x.sum(-1, keepdim=True).expand(2, 4))


def test_autograd_and_other_dtypes_take_f_linear():
    layer = Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()  # the packed op has no autograd kernel: this must take F.linear
    assert x.grad is not None and layer.weight.grad is not None
    with torch.no_grad():
        out = linear(x.double(), layer.weight.double())
    assert out.dtype == torch.float64


def test_a_weight_made_under_inference_mode_takes_f_linear():
    with torch.inference_mode():  # such a weight has no version counter to notice in-place changes by
        weight, x = torch.randn(16, 32), torch.randn(4, 32)
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight))
        assert weight not in cpu_linear._PACKED


def test_switched_off_keeps_no_packed_copies():
    weight, x = torch.randn(16, 32), torch.randn(4, 32)
    with torch.no_grad():
        linear(x, weight)
        assert weight in cpu_linear._PACKED
        cpu_linear.set_prepacking(False)
        assert weight not in cpu_linear._PACKED
        linear(x, weight)
        assert weight not in cpu_linear._PACKED


def test_linear_module_is_an_nn_linear_with_the_same_state_dict():
    layer = Linear(8, 4, bias=True)
    reference = nn.Linear(8, 4, bias=True)
    reference.load_state_dict(layer.state_dict())
    assert isinstance(layer, nn.Linear) and list(layer.state_dict()) == ["weight", "bias"]
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value, enabled", [("0", False), ("1", True)])
def test_environment_switch(value, enabled):
    code = "from nebula_engine.kernels import cpu_linear; print(cpu_linear.prepacking_enabled())"
    env = {**os.environ, cpu_linear.PREPACK_ENV: value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(enabled)


def test_prepack_packs_what_the_forward_uses_and_nothing_else():
    from nebula_engine.model.layers import FusedProjections

    class Attention(FusedProjections):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.o_proj = Linear(8, 8), Linear(8, 4), Linear(8, 8)
            self.fuse("qk", "q_proj", "k_proj")

    module = Attention()
    assert cpu_linear.prepack(module) == 2
    packed = set(map(id, cpu_linear._PACKED.keys()))
    assert {id(module.qk_weight), id(module.o_proj.weight)} <= packed
    assert not {id(module.q_proj.weight), id(module.k_proj.weight)} & packed  # slices of qk_weight
    with torch.no_grad():
        x = torch.randn(3, 8)
        torch.testing.assert_close(linear(x, module.qk_weight, module.qk_bias),
                                   torch.cat([F.linear(x, module.q_proj.weight, module.q_proj.bias),
                                              F.linear(x, module.k_proj.weight, module.k_proj.bias)], -1))


def test_prepack_does_nothing_when_prepacking_is_off():
    cpu_linear.set_prepacking(False)
    assert cpu_linear.prepack(Linear(8, 8)) == 0 and not len(cpu_linear._PACKED)


def test_a_loaded_model_is_packed_before_its_first_forward(tmp_path):
    from nebula_engine.model.loader import load_model
    from nebula_engine.model.tiny import make_tiny_checkpoint

    model, _, _ = load_model(str(make_tiny_checkpoint("qwen3", tmp_path / "ckpt")))
    weights = [w for m in model.modules() for w in getattr(m, "linear_weights", tuple)()]
    assert weights and all(w in cpu_linear._PACKED for w in weights)

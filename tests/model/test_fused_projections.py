"""Fused q/k/v and gate/up projections: the parameters keep their names and stay what one matmul reads."""

import pytest
import torch
import torch.nn.functional as F

from nebula_engine.model.layers import GatedMLP, fuse_linear_weights


def _reference(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU from the three parameters as the checkpoint names them, one matmul each."""
    gate = F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
    up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
    return F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)


def test_names_are_the_checkpoints_and_loaded_values_reach_the_fused_matmul():
    torch.manual_seed(0)
    mlp = GatedMLP(8, 12, bias=True)
    assert list(mlp.state_dict()) == ["gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias",
                                      "down_proj.weight", "down_proj.bias"]
    with torch.no_grad():  # what the weight loader does: copy into each named parameter
        for name, param in mlp.named_parameters():
            param.copy_(torch.randn(param.shape))
    x = torch.randn(5, 8)
    torch.testing.assert_close(mlp(x), _reference(mlp, x))


def test_fusion_follows_a_dtype_change():
    torch.manual_seed(1)
    mlp = GatedMLP(8, 12).to(torch.float64)  # new storage for every parameter: the fusion is rebuilt
    with torch.no_grad():
        mlp.up_proj.weight.mul_(3)
    x = torch.randn(4, 8, dtype=torch.float64)
    assert mlp.gate_up_weight.dtype == torch.float64
    torch.testing.assert_close(mlp(x), _reference(mlp, x))


def test_projections_with_and_without_bias_are_refused():
    with pytest.raises(ValueError, match="bias"):
        fuse_linear_weights(torch.nn.Linear(4, 2), torch.nn.Linear(4, 3, bias=False))

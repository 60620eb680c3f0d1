"""MoE: dispatch vs a dense reference, router semantics, and both expert weight layouts."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nebula_engine.kernels.attention import AttentionContext
from nebula_engine.model.layers import SparseMoE
from nebula_engine.model.loader import load_model
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)

MOE_CASE = CASES_BY_NAME["qwen3_moe_step2_mlp_only_no_renorm"]


def _dense_reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by a [T, E] matrix that is zero off the top-k."""
    expert_ids, weights = moe.route(x)
    mixing = torch.zeros(x.shape[0], moe.experts.num_experts).scatter(1, expert_ids, weights)  # [T, E]
    out = torch.zeros_like(x)
    for e in range(moe.experts.num_experts):
        gate, up = (x @ moe.experts.gate_up_proj[e].T).chunk(2, dim=-1)
        out += mixing[:, e : e + 1] * ((torch.nn.functional.silu(gate) * up) @ moe.experts.down_proj[e].T)
    return out


@pytest.mark.parametrize("tokens,experts,top_k,renormalize", [(1, 4, 1, False), (37, 8, 2, True), (2000, 16, 4, False)])
@torch.no_grad()
def test_dispatch_matches_dense_reference(tokens, experts, top_k, renormalize):
    torch.manual_seed(tokens)
    moe = SparseMoE(hidden_size=32, num_experts=experts, top_k=top_k, intermediate_size=24, renormalize=renormalize)
    torch.nn.init.normal_(moe.gate.weight, std=0.3)
    x = torch.randn(tokens, 32)
    torch.testing.assert_close(moe(x), _dense_reference(moe, x), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_router_renormalization():
    torch.manual_seed(0)
    x = torch.randn(10, 32)
    moe = SparseMoE(32, num_experts=8, top_k=3, intermediate_size=8, renormalize=False)
    ids, weights = moe.route(x)
    probs = torch.softmax(moe.gate(x), dim=-1)
    torch.testing.assert_close(weights, probs.gather(1, ids))
    assert (weights.sum(-1) < 1).all()
    moe.renormalize = True
    _, renormalized = moe.route(x)
    torch.testing.assert_close(renormalized.sum(-1), torch.ones(10))


def _fuse_experts(tensors: dict[str, torch.Tensor], layer: int, num_experts: int) -> None:
    """Per-expert tensors of one layer -> transformers-v5 fused ``gate_up_proj`` / ``down_proj``."""
    prefix = f"model.layers.{layer}.mlp.experts"
    pop = lambda e, part: tensors.pop(f"{prefix}.{e}.{part}_proj.weight")  # noqa: E731
    tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([pop(e, "gate"), pop(e, "up")]) for e in range(num_experts)])
    tensors[f"{prefix}.down_proj"] = torch.stack([pop(e, "down") for e in range(num_experts)])


@torch.no_grad()
def test_fused_and_per_expert_layouts_give_identical_logits(checkpoint_factory, tmp_path):
    per_expert_dir = checkpoint_factory(MOE_CASE)
    fused_dir = shutil.copytree(per_expert_dir, tmp_path / "fused")
    tensors = load_file(fused_dir / "model.safetensors")
    experts = MOE_CASE.overrides["num_experts"]
    _fuse_experts(tensors, layer=1, num_experts=experts)
    assert not any(".experts.0." in name for name in tensors if name.startswith("model.layers.1."))
    save_file(tensors, fused_dir / "model.safetensors", metadata={"format": "pt"})

    ids, positions = torch.tensor([5, 900, 77, 3, 151000, 42]), torch.arange(6)
    logits = []
    for path in (per_expert_dir, fused_dir):
        model, _, _ = load_model(str(path))
        logits.append(model.compute_logits(model(ids, positions, AttentionContext.dense([6]))))
    assert torch.equal(logits[0], logits[1])


def test_missing_expert_tensor_is_named(checkpoint_factory, tmp_path):
    checkpoint = shutil.copytree(checkpoint_factory(MOE_CASE), tmp_path / "ckpt")
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.4.up_proj.weight"]
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.layers\.1\.mlp\.experts\.4\.up_proj\.weight$"):
        load_model(str(checkpoint))


def test_layer_kinds_follow_sparse_step_and_mlp_only_layers(checkpoint_factory):
    model, _, _ = load_model(str(checkpoint_factory(MOE_CASE)))
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["GatedMLP", "SparseMoE", "GatedMLP", "GatedMLP"]  # layer 3 is in mlp_only_layers

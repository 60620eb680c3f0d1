"""DeepSeek-V2 (MLA + DeepSeekMoE): logits vs transformers, the softmax scale, routing, the latent factoring."""

from __future__ import annotations

import math

import pytest
import torch

from nebula_engine.kvcache.spec import KVCacheGroupSpec, MLALatentSpec
from nebula_engine.model.deepseek_v2 import DeepseekMoE, keep_top_groups
from nebula_engine.model.loader import load_model
from nebula_engine.model.mla import MLAttention
from tests.model.test_logits_vs_hf import _hf_model, assert_varlen_prefill_logits_match_transformers
from tests.model.test_logits_vs_hf import test_chunked_prefill_through_paged_cache_matches_dense as check_paged
from tests.model_cases import CASES_BY_NAME, HYBRID_AND_MLA_CASES, checkpoint_factory  # noqa: F401  (fixture)

DEEPSEEK_CASES = [c for c in HYBRID_AND_MLA_CASES if c.family == "deepseek_v2"]
PROMPT_LENS = [7, 1, 12, 4]


@pytest.mark.parametrize("case", DEEPSEEK_CASES, ids=str)
def test_varlen_prefill_logits_match_transformers(case, checkpoint_factory):
    assert_varlen_prefill_logits_match_transformers(str(checkpoint_factory(case)), PROMPT_LENS)


@pytest.mark.parametrize("case", DEEPSEEK_CASES, ids=str)
def test_softmax_scale_includes_mscale_squared_like_transformers(case, checkpoint_factory):
    path = str(checkpoint_factory(case))
    model, _, _ = load_model(path)
    rope = _hf_model(path).config.rope_parameters
    m = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
    expected = (16 + 8) ** -0.5 * m * m
    for ours, theirs in zip(model.attention_layers(), (layer.self_attn for layer in _hf_model(path).model.layers)):
        assert ours.scale == pytest.approx(theirs.scaling, rel=1e-12) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("case", DEEPSEEK_CASES, ids=str)
@torch.no_grad()
def test_chunked_prefill_through_paged_cache(case, checkpoint_factory):
    """MLA through the engine's paged latent cache: one group, c̃ (R = 32) + k_pe (Dr = 8) per token and layer."""
    model, config, _ = load_model(str(checkpoint_factory(case)))
    assert model.kv_cache_groups(torch.float32) == [
        KVCacheGroupSpec(tuple(range(config.num_hidden_layers)), MLALatentSpec(32, 8, torch.float32))]
    check_paged(case, checkpoint_factory)  # the same check as for the other families


@torch.no_grad()
def test_latent_is_what_keys_and_values_are_decompressed_from(checkpoint_factory):
    model, config, _ = load_model(str(checkpoint_factory(CASES_BY_NAME["deepseek_v2_lite_greedy_yarn"])))
    attn: MLAttention = model.attention_layers()[0]
    x, positions = torch.randn(5, config.hidden_size), torch.arange(3, 8)
    latent, k_pe = attn.latent(positions, x)
    assert latent.shape == (5, 32) and k_pe.shape == (5, 8)
    k, v = attn.decompress(latent, k_pe)
    assert k.shape == (5, 4, 24) and v.shape == (5, 4, 12)
    assert torch.equal(k[:, 2, 16:], k_pe)  # the rotary part is shared by all heads
    w_uk = attn.kv_b_proj.weight.view(4, 16 + 12, 32)[:, :16]  # absorption view: k_nope_h = W_UK,h c̃
    torch.testing.assert_close(k[..., :16], torch.einsum("hnr,tr->thn", w_uk, latent))
    # position p rotates k_pe by p: moving the same token 1 -> 4 re-rotates only k_pe
    _, k_pe_shifted = attn.latent(positions + 3, x)
    assert not torch.allclose(k_pe_shifted, k_pe) and torch.equal(attn.latent(positions + 3, x)[0], latent)


def test_group_limited_routing_only_picks_experts_of_the_top_groups():
    scores = torch.tensor([[0.30, 0.01, 0.02, 0.25, 0.20, 0.01, 0.18, 0.03]])  # 4 groups of 2
    kept = keep_top_groups(scores, num_groups=4, topk_groups=2)  # groups 0 (max .30) and 1 (max .25)
    assert torch.equal(kept, torch.tensor([[0.30, 0.01, 0.02, 0.25, 0.0, 0.0, 0.0, 0.0]]))


@torch.no_grad()
def test_routing_scales_weights_without_renormalising(checkpoint_factory):
    model, config, _ = load_model(str(checkpoint_factory(CASES_BY_NAME["deepseek_v2_qlora_group_limited"])))
    moe: DeepseekMoE = model.model.layers[1].mlp
    assert isinstance(moe, DeepseekMoE) and not isinstance(model.model.layers[0].mlp, DeepseekMoE)
    x = torch.randn(6, config.hidden_size)
    expert_ids, weights = moe.route(x)
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    torch.testing.assert_close(weights, probs.gather(1, expert_ids) * 2.5)
    groups = expert_ids // 2  # 8 experts in 4 groups
    assert all(len(set(row.tolist())) <= 2 for row in groups)

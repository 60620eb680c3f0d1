"""``CausalLM.run_layers``: the one layer loop, its per-layer hook, and the layer kinds hooks may ask about."""

from __future__ import annotations

import pytest
import torch

from nebula_engine.kernels.attention import AttentionContext
from nebula_engine.model.base import LayerRows
from nebula_engine.model.loader import load_model
from nebula_engine.model.mla import MLAttention
from tests.model.test_logits_vs_hf import _flatten, _random_prompts
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)

ONE_CASE_PER_FAMILY = ["llama_gqa2", "mistral_sliding_window6", "qwen3_gqa2_hd20", "qwen3_moe_renorm",
                       "deepseek_v2_lite_greedy_yarn", "qwen3_5_linear_full_linear"]
ATTENTION_ONLY = [name for name in ONE_CASE_PER_FAMILY if not name.startswith("qwen3_5")]
LENS = [7, 3]


def _model(name, checkpoint_factory):
    model, config, _ = load_model(str(checkpoint_factory(CASES_BY_NAME[name])))
    return model, _flatten(_random_prompts(config.vocab_size, LENS, seed=3))


@pytest.mark.parametrize("name", ATTENTION_ONLY)
@torch.no_grad()
def test_a_hook_that_runs_each_layer_as_is_equals_the_forward(name, checkpoint_factory):
    model, (ids, positions) = _model(name, checkpoint_factory)
    seen = []

    def as_is(layer_idx, layer, rows):
        seen.append((layer_idx, layer))
        return rows._replace(hidden=layer(*rows))

    hooked = model.run_layers(ids, positions, AttentionContext.dense(LENS), as_is)
    assert seen == list(enumerate(model.model.layers))
    assert torch.equal(hooked.hidden, model(ids, positions, AttentionContext.dense(LENS)))
    assert hooked.positions is positions


@torch.no_grad()
def test_rows_a_hook_drops_do_not_reach_later_layers(checkpoint_factory):
    model, (ids, positions) = _model("llama_gqa2", checkpoint_factory)
    single = ids[:LENS[0]], positions[:LENS[0]]
    rows_in = []

    def keep_last_after_layer_0(layer_idx, layer, rows):
        rows_in.append(rows.positions.tolist())
        hidden = layer(*rows)
        if layer_idx > 0:
            return rows._replace(hidden=hidden)
        return LayerRows(rows.positions[-1:], hidden[-1:], AttentionContext.dense([1]))

    out = model.run_layers(*single, AttentionContext.dense([LENS[0]]), keep_last_after_layer_0)
    assert rows_in == [list(range(LENS[0])), [LENS[0] - 1]]
    assert out.positions.tolist() == [LENS[0] - 1] and out.hidden.shape == (1, model.config.hidden_size)


@torch.no_grad()
def test_hybrid_forward_runs_the_same_loop(checkpoint_factory):
    """Qwen3.5's forward carries linear states through ``run_layers``: one state list per linear layer."""
    model, (ids, positions) = _model("qwen3_5_linear_full_linear", checkpoint_factory)
    hidden, states = model.forward_with_states(ids, positions, AttentionContext.dense(LENS))
    assert torch.equal(hidden, model(ids, positions, AttentionContext.dense(LENS)))
    assert len(states) == model.num_linear_layers == 2 and all(len(s) == len(LENS) for s in states)


@pytest.mark.parametrize("name", ONE_CASE_PER_FAMILY)
def test_layers_say_their_kind(name, checkpoint_factory):
    model, _ = _model(name, checkpoint_factory)
    linear = [layer.is_linear for layer in model.model.layers]
    assert model.num_linear_layers == sum(linear) == len(model.linear_attention_layers())
    assert [m.linear_layer_idx for m in model.linear_attention_layers()] == list(range(sum(linear)))
    for attention in model.attention_layers():
        expected = attention.mla.qk_rope_head_dim if isinstance(attention, MLAttention) else None
        assert attention.latent_rope_dim == expected

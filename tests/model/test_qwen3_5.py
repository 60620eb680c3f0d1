"""Qwen3.5 hybrid models: logits vs transformers, state continuation, and the vision-language checkpoint layout."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from nebula_engine.kernels.attention import AttentionContext, AttentionMetadata, TorchPagedAttention
from nebula_engine.model.config import ModelConfig
from nebula_engine.model.gated_deltanet import GatedDeltaNet
from nebula_engine.model.loader import load_model
from nebula_engine.model.qwen3_5 import layer_types
from tests.model.test_logits_vs_hf import (_flatten, _random_prompts,
                                         assert_varlen_prefill_logits_match_transformers)
from tests.model_cases import CASES_BY_NAME, HYBRID_AND_MLA_CASES, checkpoint_factory  # noqa: F401  (fixture)

QWEN3_5_CASES = [c for c in HYBRID_AND_MLA_CASES if c.family.startswith("qwen3_5")]
DENSE = CASES_BY_NAME["qwen3_5_linear_full_linear"]
PROMPT_LENS = [9, 1, 70, 4]  # 70 > the 64-token chunk of the gated delta rule


@pytest.mark.parametrize("case", QWEN3_5_CASES, ids=str)
def test_varlen_prefill_logits_match_transformers(case, checkpoint_factory):
    assert_varlen_prefill_logits_match_transformers(str(checkpoint_factory(case)), PROMPT_LENS)


@pytest.mark.parametrize("case", QWEN3_5_CASES, ids=str)
def test_attention_layers_are_indexed_among_full_attention_layers(case, checkpoint_factory):
    model, config, _ = load_model(str(checkpoint_factory(case)))
    kinds = layer_types(config.hf_config, config.num_hidden_layers)
    assert [m.attn_layer_idx for m in model.attention_layers()] == list(range(kinds.count("full_attention")))
    assert model.kv_cache_shape_per_layer() == [(2, 32, 32)] * kinds.count("full_attention")
    assert model.num_linear_layers == kinds.count("linear_attention")


@pytest.mark.parametrize("split", [1, 2, 5, 40])
@torch.no_grad()
def test_linear_layer_continues_from_returned_state(split, checkpoint_factory):
    """Splits before the conv window fills (1, 2 < K-1 = 3), 1-token recurrent tails, and multi-chunk heads."""
    model, config, _ = load_model(str(checkpoint_factory(DENSE)))
    layer: GatedDeltaNet = model.model.layers[0].linear_attn
    layer.chunk_size = 16
    x = torch.randn(41, config.hidden_size)
    whole, whole_state = layer(x)
    head, state = layer(x[:split])
    tail, tail_state = layer(x[split:], state)
    torch.testing.assert_close(torch.cat([head, tail]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tail_state.recurrent, whole_state.recurrent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tail_state.conv, whole_state.conv)
    assert whole_state.conv.shape == (layer.cfg.conv_channels, 3)


@torch.no_grad()
def test_batched_decode_step_equals_each_sequence_alone(checkpoint_factory):
    """GatedDeltaNet.decode over B stacked states == forward(1 token, state) per sequence (contexts 1, 2, 9)."""
    model, config, _ = load_model(str(checkpoint_factory(DENSE)))
    layer: GatedDeltaNet = model.model.layers[0].linear_attn
    contexts = [torch.randn(n, config.hidden_size, generator=torch.Generator().manual_seed(n)) for n in (1, 2, 9)]
    states = [layer(x)[1] for x in contexts]
    tokens = torch.randn(len(contexts), config.hidden_size)
    out, conv, recurrent = layer.decode(tokens, torch.stack([s.conv for s in states]),
                                        torch.stack([s.recurrent for s in states]))
    for b, state in enumerate(states):
        expected, expected_state = layer(tokens[b:b + 1], state)
        torch.testing.assert_close(out[b:b + 1], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv[b], expected_state.conv, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(recurrent[b], expected_state.recurrent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", QWEN3_5_CASES, ids=str)
@torch.no_grad()
def test_mixed_batch_of_decode_tokens_and_a_prefill_chunk_equals_each_sequence_alone(case, checkpoint_factory):
    """Two 1-token continuations (batched decode) around a prefill continuation, vs each sequence alone."""
    model, config, _ = load_model(str(checkpoint_factory(case)))
    lens, split, page_size = [6, 11, 5], [5, 7, 4], 4
    prompts = _random_prompts(config.vocab_size, lens, seed=2)
    block_tables = torch.tensor([[0, 1, 0], [2, 3, 4], [5, 6, 0]])

    def run(seqs):
        kv_caches = [(torch.zeros(8, page_size, h, d), torch.zeros(8, page_size, h, dv))
                     for h, d, dv in model.kv_cache_shape_per_layer()]
        chosen = ([prompts[b] for b in seqs], block_tables[seqs])
        _, states = _chunk_forward(model, *chosen[:1], [(0, split[b]) for b in seqs], chosen[1], kv_caches,
                                   page_size, None)
        logits, _ = _chunk_forward(model, *chosen[:1], [(split[b], lens[b]) for b in seqs], chosen[1], kv_caches,
                                   page_size, states)
        return logits

    together = run([0, 1, 2])
    for b in range(3):
        torch.testing.assert_close(together[b], run([b])[0], atol=1e-4, rtol=1e-4)


def _chunk_forward(model, prompts, bounds, block_tables, kv_caches, page_size, states):
    """One step over sequences b's tokens bounds[b] = (start, end), through the paged KV cache."""
    ids = torch.cat([p[s:e] for p, (s, e) in zip(prompts, bounds)])
    positions = torch.cat([torch.arange(s, e) for s, e in bounds])
    slots = torch.cat([block_tables[b][torch.arange(s, e) // page_size] * page_size + torch.arange(s, e) % page_size
                       for b, (s, e) in enumerate(bounds)])
    starts = [0]
    for s, e in bounds:
        starts.append(starts[-1] + e - s)
    meta = AttentionMetadata(starts, [e for _, e in bounds], block_tables, slots, page_size)
    hidden, states = model.forward_with_states(ids, positions, AttentionContext(TorchPagedAttention(), meta, kv_caches),
                                               states)
    return model.compute_logits(hidden).split([e - s for s, e in bounds]), states


@pytest.mark.parametrize("case", QWEN3_5_CASES, ids=str)
@torch.no_grad()
def test_prefill_then_continue_from_states_equals_one_prefill(case, checkpoint_factory):
    """prefill(a) -> (KV pages, linear states); prefill(b) from them == prefill(a + b), per sequence of a batch."""
    model, config, _ = load_model(str(checkpoint_factory(case)))
    lens, split, page_size = [11, 6], [7, 1], 4
    prompts = _random_prompts(config.vocab_size, lens, seed=1)
    dense = model.compute_logits(model(*_flatten(prompts), AttentionContext.dense(lens)))
    kv_caches = [(torch.zeros(8, page_size, h, d), torch.zeros(8, page_size, h, dv))
                 for h, d, dv in model.kv_cache_shape_per_layer()]
    block_tables = torch.tensor([[0, 1, 2], [4, 5, 6]])
    run = (model, prompts)
    first, states = _chunk_forward(*run, [(0, split[0]), (0, split[1])], block_tables, kv_caches, page_size, None)
    assert len(states) == model.num_linear_layers and all(len(s) == 2 for s in states)
    second, _ = _chunk_forward(*run, [(split[0], lens[0]), (split[1], lens[1])], block_tables, kv_caches, page_size,
                               states)
    continued = torch.cat([first[0], second[0], first[1], second[1]])
    torch.testing.assert_close(continued, dense, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="linear-attention states must be passed"):
        _chunk_forward(*run, [(split[0], lens[0]), (split[1], lens[1])], block_tables, kv_caches, page_size, None)


def _vision_language_checkpoint(text_dir, out_dir):
    """The text model inside transformers' own Qwen3_5ForConditionalGeneration, plus an MTP tensor."""
    text = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=text.config.hidden_size)
    wrapper = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text.config.to_dict(), vision_config=vision, tie_word_embeddings=False))
    wrapper.model.language_model.load_state_dict(text.model.state_dict())
    wrapper.lm_head.load_state_dict(text.lm_head.state_dict())
    wrapper.save_pretrained(out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


@torch.no_grad()
def test_vision_language_checkpoint_loads_its_text_model(checkpoint_factory, tmp_path):
    text_dir = checkpoint_factory(DENSE)
    vl_dir = _vision_language_checkpoint(text_dir, tmp_path / "vl")
    raw = json.loads((vl_dir / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5" and "text_config" in raw
    assert any(n.startswith("model.visual.") for n in load_file(vl_dir / "model.safetensors"))
    vl_model, vl_config, _ = load_model(str(vl_dir))
    text_model, text_config, _ = load_model(str(text_dir))
    assert vl_config.hidden_size == text_config.hidden_size and vl_config.rope == text_config.rope
    for (name, ours), (_, theirs) in zip(vl_model.state_dict().items(), text_model.state_dict().items()):
        assert torch.equal(ours, theirs), name


def test_config_defaults_layer_types_and_partial_rotary():
    raw = dict(model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
               vocab_size=100, intermediate_size=128)
    config = ModelConfig.from_hf(raw)
    assert config.rope.rotary_dim == 16 // 4  # transformers' default partial_rotary_factor for Qwen3.5
    assert layer_types(config.hf_config, 8) == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    assert layer_types({**raw, "full_attention_interval": 2}, 4)[1::2] == ["full_attention"] * 2
    with pytest.raises(ValueError, match="layer_types"):
        layer_types({**raw, "layer_types": ["full_attention", "mamba"]}, 2)

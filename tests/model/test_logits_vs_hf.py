"""Prefill logits of every model case, loaded from disk by our loader, match transformers in fp32."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from nebula_engine.kernels.attention import AttentionContext, AttentionMetadata, TorchPagedAttention
from nebula_engine.kernels.mla_attention import TorchMLAAttention
from nebula_engine.kvcache.pool import KVCacheStorage
from nebula_engine.model.loader import load_model
from tests.model_cases import CASES_BY_NAME, MODEL_CASES, checkpoint_factory  # noqa: F401  (fixture)

PROMPT_LENS = [7, 1, 12, 4]


@functools.cache
def _hf_model(path: str) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _random_prompts(vocab_size: int, lens: list[int], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator) for n in lens]


def _flatten(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    return ids, positions


@torch.no_grad()
def assert_varlen_prefill_logits_match_transformers(path: str, prompt_lens: list[int]) -> None:
    """One varlen batch through our loader and model equals transformers, prompt by prompt (fp32)."""
    model, config, _ = load_model(path)
    prompts = _random_prompts(config.vocab_size, prompt_lens)
    ids, positions = _flatten(prompts)

    logits = model.compute_logits(model(ids, positions, AttentionContext.dense(prompt_lens)))
    reference = torch.cat([_hf_model(path)(p[None]).logits[0] for p in prompts])

    assert logits.dtype == torch.float32 and logits.shape == (sum(prompt_lens), config.vocab_size)
    assert reference.std() > 0.3, "random logits too flat to compare meaningfully"
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("case", MODEL_CASES, ids=str)
def test_varlen_prefill_logits_match_transformers(case, checkpoint_factory):
    assert_varlen_prefill_logits_match_transformers(str(checkpoint_factory(case)), PROMPT_LENS)


def _paged_context(model, num_pages: int, page_size: int) -> list[tuple[torch.Tensor, ...]]:
    return KVCacheStorage(model.kv_cache_groups(torch.float32), num_pages, page_size, "cpu").layer_caches


PAGED_CASES = [CASES_BY_NAME[n] for n in ("mistral_gqa2", "qwen3_gqa2_hd20", "qwen3_moe_step2_mlp_only_no_renorm")]


@pytest.mark.parametrize("case", PAGED_CASES, ids=str)
@torch.no_grad()
def test_chunked_prefill_through_paged_cache_matches_dense(case, checkpoint_factory):
    """Two chunks per sequence through a paged KV cache give the dense single-pass logits."""
    model, config, _ = load_model(str(checkpoint_factory(case)))
    assert model.num_attention_layers == config.num_hidden_layers
    page_size, lens, split = 4, [9, 6], [5, 2]
    prompts = _random_prompts(config.vocab_size, lens, seed=1)
    ids, positions = _flatten(prompts)
    dense = model.compute_logits(model(ids, positions, AttentionContext.dense(lens)))

    kv_caches = _paged_context(model, num_pages=8, page_size=page_size)
    block_tables = torch.tensor([[0, 1, 2], [4, 5, 6]])
    chunks = [[(0, split[b]) for b in range(2)], [(split[b], lens[b]) for b in range(2)]]
    outputs = []
    for chunk in chunks:
        chunk_ids = torch.cat([prompts[b][s:e] for b, (s, e) in enumerate(chunk)])
        chunk_pos = torch.cat([torch.arange(s, e) for s, e in chunk])
        slots = torch.cat([block_tables[b][torch.arange(s, e) // page_size] * page_size + torch.arange(s, e) % page_size
                           for b, (s, e) in enumerate(chunk)])
        starts = [0, chunk[0][1] - chunk[0][0], chunk[0][1] - chunk[0][0] + chunk[1][1] - chunk[1][0]]
        meta = AttentionMetadata(starts, [e for _, e in chunk], block_tables, slots, page_size)
        ctx = AttentionContext(TorchPagedAttention(), meta, kv_caches, TorchMLAAttention())
        outputs.append(model.compute_logits(model(chunk_ids, chunk_pos, ctx)).split([e - s for s, e in chunk]))
    paged = torch.cat([torch.cat([outputs[0][b], outputs[1][b]]) for b in range(2)])
    torch.testing.assert_close(paged, dense, atol=1e-4, rtol=1e-4)

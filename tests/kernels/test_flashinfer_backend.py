"""The FlashInfer attention backend against TorchPagedAttention on the same batches and caches.

The comparisons need CUDA and flashinfer (run by tools/gpu_check.sh); without CUDA only the refusal is tested.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nebula_engine.kernels.attention import AttentionMetadata, TorchPagedAttention
from nebula_engine.kernels.flashinfer_backend import FlashInferAttention

HAS_FLASHINFER = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
needs_flashinfer = pytest.mark.skipif(not HAS_FLASHINFER, reason="needs CUDA and flashinfer")
PAGE_SIZE = 16
NUM_PAGES = 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_construction_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA"):
        FlashInferAttention()


def _batch(spans: list[tuple[int, int]], kv_heads: int, head_dim: int, seed: int, positions=None):
    """Metadata and a filled cache for sequences given as (cached tokens, new tokens); new tokens are the last
    of their context unless ``positions`` (per sequence, absolute positions of the new tokens) says otherwise."""
    gen = torch.Generator().manual_seed(seed)
    page_ids = torch.randperm(NUM_PAGES, generator=gen)
    max_pages = max(-(-(c + n) // PAGE_SIZE) for c, n in spans)
    tables = page_ids[: len(spans) * max_pages].view(len(spans), max_pages)
    starts, slots, query_positions = [0], [], []
    for b, (cached, new) in enumerate(spans):
        rows = list(range(cached, cached + new)) if positions is None else positions[b]
        slots += [int(tables[b, p // PAGE_SIZE]) * PAGE_SIZE + p % PAGE_SIZE for p in rows]
        query_positions += rows
        starts.append(starts[-1] + len(rows))
    seq_lens = [c + n for c, n in spans] if positions is None else [c for c, _ in spans]
    extra = {} if positions is None else {"query_positions": torch.tensor(query_positions, device="cuda")}
    meta = AttentionMetadata(starts, seq_lens, tables.cuda(), torch.tensor(slots, device="cuda"), PAGE_SIZE, **extra)
    shape = (NUM_PAGES, PAGE_SIZE, kv_heads, head_dim)
    cache = tuple(torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    return meta, cache


def _compare(meta, cache, heads, kv_heads, head_dim, window=None, seed=0, backend=None):
    gen = torch.Generator().manual_seed(seed)
    tokens = meta.query_start_loc[-1]
    q, k, v = (torch.randn(tokens, h, head_dim, generator=gen).to("cuda", torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))
    torch_cache = tuple(c.clone() for c in cache)
    expected = TorchPagedAttention().forward(q, k, v, torch_cache, meta, head_dim**-0.5, window)
    out = (backend or FlashInferAttention()).forward(q, k, v, cache, meta, head_dim**-0.5, window)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert all(torch.equal(a, b) for a, b in zip(cache, torch_cache))  # K/V written to the same slots


@needs_flashinfer
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 128), (4, 4, 128)])
@pytest.mark.parametrize("spans", [[(0, 37), (0, 16)], [(40, 9), (5, 30)], [(70, 1), (33, 1), (1, 1)],
                                   [(50, 1), (20, 12)]], ids=["fresh", "chunked", "decode", "mixed"])
@pytest.mark.parametrize("window", [None, 24])
def test_matches_torch_backend(heads, kv_heads, head_dim, spans, window):
    meta, cache = _batch(spans, kv_heads, head_dim, seed=len(spans))
    _compare(meta, cache, heads, kv_heads, head_dim, window)


@needs_flashinfer
@pytest.mark.parametrize("window", [None, 10])
def test_scattered_query_positions_match_torch_backend(window):
    """PIC combine prefill: recomputed rows sit inside their context (exact per-row causal mask)."""
    positions = [[0, 1, 2, 17, 18, 40, 41, 42], [3, 29]]
    meta, cache = _batch([(43, 0), (30, 0)], 2, 128, seed=5, positions=positions)
    _compare(meta, cache, 8, 2, 128, window)


@needs_flashinfer
def test_one_plan_serves_every_layer_and_a_new_batch_replans():
    backend = FlashInferAttention()
    meta, cache = _batch([(20, 5), (0, 9)], 2, 128, seed=6)
    for layer in range(3):  # same metadata object: planned once, fresh activations per layer
        _compare(meta, tuple(c.clone() for c in cache), 8, 2, 128, seed=layer, backend=backend)
    new_meta, new_cache = _batch([(3, 1), (60, 1), (17, 1)], 2, 128, seed=7)
    _compare(new_meta, new_cache, 8, 2, 128, backend=backend)


@needs_flashinfer
def test_without_a_cache_each_sequence_attends_causally_to_itself():
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(21, h, 128, generator=gen).to("cuda", torch.bfloat16) for h in (4, 2, 2))
    meta = AttentionMetadata.dense([13, 8])
    expected = TorchPagedAttention().forward(q, k, v, None, meta, 0.125)
    out = FlashInferAttention().forward(q, k, v, None, meta, 0.125)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@needs_flashinfer
def test_fp32_is_refused():
    meta, cache = _batch([(0, 4)], 1, 64, seed=9)
    q = torch.randn(4, 1, 64, device="cuda")
    with pytest.raises(ValueError, match="fp16/bf16"):
        FlashInferAttention().forward(q, q, q, cache, meta, 0.125)

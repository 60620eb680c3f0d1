"""The paged attention paths against plain causal attention over the gathered context."""

import shutil

import pytest
import torch

from nebula_engine.kernels import cpu_paged_decode
from nebula_engine.kernels.attention import (AttentionMetadata, TorchPagedAttention, causal_attention,
                                             decode_attention, gather_kv)

PAGE_SIZE = 4


@pytest.fixture(params=["cpu-kernel", "torch"])
def decode_path(request):
    """Backend decode through the C++ kernel (reads pages in place) and through gather + SDPA."""
    kernel = request.param == "cpu-kernel"
    if kernel and shutil.which("c++") is None:
        pytest.skip("no C++ compiler to build the kernel with")
    previous = cpu_paged_decode.set_enabled(kernel)
    yield request.param
    cpu_paged_decode.set_enabled(previous)


def _cache(num_pages, num_kv_heads, head_dim, v_head_dim, generator):
    k = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim, generator=generator)
    v = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, v_head_dim, generator=generator)
    return k, v


@pytest.mark.parametrize("pages", [[3, 4, 5], [7, 2, 3, 9], [5], [1, 0, 6, 7, 8], [9, 7, 5, 3, 1, 2], [0, 1, 2, 3, 4, 9, 5, 6, 7, 8, 10]])
@pytest.mark.parametrize("heads,kv_heads,head_dim,v_head_dim", [(4, 4, 8, 8), (8, 2, 16, 8), (6, 1, 12, 20)])
def test_decode_attention_matches_gathered_causal_attention(pages, heads, kv_heads, head_dim, v_head_dim):
    generator = torch.Generator().manual_seed(len(pages) * 100 + heads)
    k_cache, v_cache = _cache(12, kv_heads, head_dim, v_head_dim, generator)
    length = len(pages) * PAGE_SIZE - 1  # last page partly filled: its tail must be ignored
    q = torch.randn(1, heads, head_dim, generator=generator)
    block_table = torch.tensor(pages)
    meta = AttentionMetadata([0, 1], [length], block_table[None], None, PAGE_SIZE)

    ours = decode_attention(q, k_cache, v_cache, meta.context_plans[0], scale=0.3)

    k, v = gather_kv(k_cache, v_cache, block_table, length)
    torch.testing.assert_close(ours, causal_attention(q, k, v, scale=0.3), atol=1e-5, rtol=1e-5)


def test_page_runs_split_at_gaps_and_cover_only_the_context():
    tables = torch.tensor([[4, 5, 6, 0, 0], [9, 2, 3, 7, 8]])
    meta = AttentionMetadata([0, 1, 2], [9, 17], tables, None, PAGE_SIZE)
    assert meta.page_runs == [[(4, 3)], [(9, 1), (2, 2), (7, 2)]]


def test_backend_decode_rows_match_prefill_rows_of_one_longer_pass(decode_path):
    """Decode through the backend equals the last row of a full causal pass over the same tokens."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, length = 4, 2, 8, 11
    q = torch.randn(length, heads, dim, generator=generator)
    k = torch.randn(length, kv_heads, dim, generator=generator)
    v = torch.randn(length, kv_heads, dim, generator=generator)
    k_cache, v_cache = torch.zeros(8, PAGE_SIZE, kv_heads, dim), torch.zeros(8, PAGE_SIZE, kv_heads, dim)
    block_table = torch.tensor([[6, 1, 2]])
    slots = torch.tensor([block_table[0, i // PAGE_SIZE] * PAGE_SIZE + i % PAGE_SIZE for i in range(length)])
    backend = TorchPagedAttention()
    prefill = AttentionMetadata([0, length - 1], [length - 1], block_table, slots[:-1], PAGE_SIZE)
    backend.forward(q[:-1], k[:-1], v[:-1], (k_cache, v_cache), prefill, scale=0.5)
    decode = AttentionMetadata([0, 1], [length], block_table, slots[-1:], PAGE_SIZE)
    out = backend.forward(q[-1:], k[-1:], v[-1:], (k_cache, v_cache), decode, scale=0.5)
    torch.testing.assert_close(out, causal_attention(q, k, v, scale=0.5)[-1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_len,ctx_len,window", [(9, 9, 4), (3, 11, 5), (1, 11, 5), (4, 6, 8)])
def test_sliding_window_sees_only_the_last_window_keys(q_len, ctx_len, window):
    """Query at position i attends to keys i-W < j <= i, checked against softmax written out per query."""
    generator = torch.Generator().manual_seed(q_len * 31 + ctx_len)
    q = torch.randn(q_len, 4, 8, generator=generator)
    k = torch.randn(ctx_len, 2, 8, generator=generator)
    v = torch.randn(ctx_len, 2, 6, generator=generator)
    ours = causal_attention(q, k, v, scale=0.4, sliding_window=window)
    for row in range(q_len):
        position = ctx_len - q_len + row
        keys = range(max(0, position - window + 1), position + 1)
        k_seen, v_seen = k[list(keys)].repeat_interleave(2, 1), v[list(keys)].repeat_interleave(2, 1)
        probs = (torch.einsum("hd,lhd->hl", q[row], k_seen) * 0.4).softmax(-1)
        torch.testing.assert_close(ours[row], torch.einsum("hl,lhd->hd", probs, v_seen), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 3, 6])
def test_batched_decode_rows_match_each_sequence_alone(window, decode_path):
    """Decode rows of several sequences (scattered pages, different lengths, a prefill chunk between them) read
    in one batched call equal causal attention over each sequence's own gathered context."""
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, v_dim = 6, 2, 8, 5
    k_cache, v_cache = _cache(16, kv_heads, dim, v_dim, generator)
    tables = torch.tensor([[3, 9, 1, 0], [12, 4, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]])
    seq_lens, query_lens = [10, 5, 14, 2], [1, 1, 3, 1]  # sequence 2 is a prefill chunk, not decode
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, dim, generator=generator)
    meta = AttentionMetadata(starts, seq_lens, tables, None, PAGE_SIZE)
    assert meta.decode_batch.seqs == [0, 1, 3] and not meta.decode_batch.covers_batch

    unused_k, unused_v = torch.empty(starts[-1], kv_heads, dim), torch.empty(starts[-1], kv_heads, v_dim)  # no slots
    out = TorchPagedAttention().forward(q, unused_k, unused_v, (k_cache, v_cache), meta, scale=0.3,
                                        sliding_window=window)

    for b, (start, end) in enumerate(zip(starts, starts[1:])):
        k, v = gather_kv(k_cache, v_cache, tables[b], seq_lens[b])
        expected = causal_attention(q[start:end], k, v, scale=0.3, sliding_window=window)
        torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=1e-5)


def test_batch_of_only_decode_rows_is_one_call_that_reads_no_slot_outside_the_contexts(decode_path):
    """Slots past a context (a page's unused tail, other pages) hold NaN, as garbage or a failed request's
    leftovers can: the shorter sequence's padding must not read them."""
    generator = torch.Generator().manual_seed(3)
    k_cache, v_cache = _cache(10, 1, 4, 4, generator)
    tables = torch.tensor([[4, 2, 8], [7, 0, 0]])
    used = torch.zeros(10, PAGE_SIZE, dtype=torch.bool)
    used[4], used[2], used[8, :3], used[7, :3] = True, True, True, True
    k_cache[~used], v_cache[~used] = float("nan"), float("nan")
    q = torch.randn(2, 3, 4, generator=generator)
    meta = AttentionMetadata([0, 1, 2], [11, 3], tables, None, PAGE_SIZE)
    assert meta.decode_batch.covers_batch

    out = TorchPagedAttention().forward(q, torch.empty(2, 1, 4), torch.empty(2, 1, 4), (k_cache, v_cache), meta,
                                        scale=0.5)

    for b in range(2):
        k, v = gather_kv(k_cache, v_cache, tables[b], meta.seq_lens[b])
        torch.testing.assert_close(out[b:b + 1], causal_attention(q[b:b + 1], k, v, scale=0.5), atol=1e-5, rtol=1e-5)


def _attention_written_out(q, k, v, scale, positions):
    """Softmax attention of query row i over keys 0..positions[i], one row at a time."""
    group = q.shape[1] // k.shape[1]
    k_all, v_all = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    rows = []
    for row, position in enumerate(positions):
        probs = (torch.einsum("hd,lhd->hl", q[row], k_all[: position + 1]) * scale).softmax(-1)
        rows.append(torch.einsum("hl,lhd->hd", probs, v_all[: position + 1]))
    return torch.stack(rows)


@pytest.mark.parametrize("q_len,ctx_len", [(5, 40), (300, 301), (300, 700), (1, 9)])
def test_queries_at_the_end_of_a_cached_context_split_without_a_mask(q_len, ctx_len):
    """A prefill chunk after cached tokens: the keys before it unmasked, its own causally, merged exactly."""
    generator = torch.Generator().manual_seed(q_len + ctx_len)
    q = torch.randn(q_len, 8, 16, generator=generator)
    k, v = torch.randn(ctx_len, 2, 16, generator=generator), torch.randn(ctx_len, 2, 16, generator=generator)
    expected = _attention_written_out(q, k, v, 0.3, range(ctx_len - q_len, ctx_len))
    torch.testing.assert_close(causal_attention(q, k, v, scale=0.3), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["scattered", "first-rows", "one-block-same-start", "unsorted"])
def test_scattered_query_rows_match_softmax_written_out(case):
    """PIC's recomputed rows at arbitrary positions, more rows than one split block, rows that see no key of a
    block's masked part (its first positions), and positions out of order (one masked call)."""
    generator = torch.Generator().manual_seed(len(case))
    ctx_len = 900
    if case == "scattered":
        positions = torch.randperm(ctx_len, generator=generator)[:300].sort().values
    elif case == "first-rows":
        positions = torch.cat([torch.arange(0, 140), torch.arange(500, 640)])
    elif case == "one-block-same-start":
        positions = torch.tensor([7, 7 + 1, 300, 301, 899])
    else:
        positions = torch.randperm(ctx_len, generator=generator)[:50]
    q = torch.randn(len(positions), 6, 8, generator=generator)
    k, v = torch.randn(ctx_len, 3, 8, generator=generator), torch.randn(ctx_len, 3, 8, generator=generator)
    ours = causal_attention(q, k, v, scale=0.4, q_positions=positions)
    torch.testing.assert_close(ours, _attention_written_out(q, k, v, 0.4, positions.tolist()), atol=2e-5, rtol=1e-4)


def test_no_query_rows_is_an_empty_result_not_a_crash():
    """torch's CPU flash kernel divides by zero on an empty query (SIGFPE kills the process)."""
    k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 6)
    assert causal_attention(torch.randn(0, 4, 8), k, v, scale=0.5).shape == (0, 4, 6)
    no_rows = torch.zeros(0, dtype=torch.long)
    assert causal_attention(torch.randn(0, 4, 8), k, v, scale=0.5, q_positions=no_rows).shape == (0, 4, 6)

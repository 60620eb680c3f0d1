"""MLA over the latent cache: weight absorption equals decompression, through pages and chunks."""

import pytest
import torch

from nebula_engine.kernels import mla_attention
from nebula_engine.kernels.attention import AttentionContext, AttentionMetadata, TorchPagedAttention
from nebula_engine.kernels.mla_attention import (MLAParams, TorchMLAAttention, absorbed_attention,
                                                 batched_absorbed_decode, decompressed_attention, gather_latent,
                                                 write_latent)


def _params(heads, nope, v_dim, rank, generator):
    kv_b = torch.randn(heads, nope + v_dim, rank, generator=generator) / rank**0.5
    return MLAParams(kv_b, nope, scale=0.3)


def _activations(tokens, heads, nope, rope, rank, generator):
    shapes = [(tokens, heads, nope), (tokens, heads, rope), (tokens, rank), (tokens, rope)]
    return tuple(torch.randn(shape, generator=generator) for shape in shapes)


@pytest.mark.parametrize("heads,nope,rope,v_dim,rank", [(1, 4, 2, 4, 8), (4, 16, 8, 12, 32), (3, 8, 4, 16, 20)])
@pytest.mark.parametrize("q_len,ctx_len", [(1, 1), (1, 13), (5, 5), (4, 11)])
def test_absorbed_equals_decompressed(heads, nope, rope, v_dim, rank, q_len, ctx_len):
    generator = torch.Generator().manual_seed(heads * 100 + ctx_len)
    params = _params(heads, nope, v_dim, rank, generator)
    q_nope, q_pe, latent, k_pe = _activations(ctx_len, heads, nope, rope, rank, generator)
    q_nope, q_pe = q_nope[-q_len:], q_pe[-q_len:]
    expected = decompressed_attention(q_nope, q_pe, latent, k_pe, params)
    absorbed = absorbed_attention(q_nope, q_pe, torch.cat([latent, k_pe], dim=-1), params)
    assert expected.shape == (q_len, heads, v_dim)
    torch.testing.assert_close(absorbed, expected, atol=1e-5, rtol=1e-5)


def test_decompressed_attention_is_standard_attention_on_decompressed_keys():
    """K_h = [W_UK,h c̃; k_pe], V_h = W_UV,h c̃ fed to the full-attention backend give the same output."""
    generator = torch.Generator().manual_seed(0)
    heads, nope, rope, v_dim, rank, tokens = 4, 16, 8, 12, 32, 9
    params = _params(heads, nope, v_dim, rank, generator)
    q_nope, q_pe, latent, k_pe = _activations(tokens, heads, nope, rope, rank, generator)
    k = torch.cat([torch.einsum("hnr,tr->thn", params.w_uk, latent), k_pe[:, None].expand(-1, heads, -1)], dim=-1)
    v = torch.einsum("hvr,tr->thv", params.w_uv, latent)
    reference = AttentionContext(TorchPagedAttention(), AttentionMetadata.dense([tokens])).attend(
        0, torch.cat([q_nope, q_pe], dim=-1), k, v, params.scale)
    torch.testing.assert_close(decompressed_attention(q_nope, q_pe, latent, k_pe, params), reference,
                               atol=1e-5, rtol=1e-5)


def test_latent_rows_round_trip_through_pages():
    cache = torch.full((4, 3, 6), float("nan"))
    latent, k_pe = torch.arange(20.0).view(5, 4), -torch.arange(10.0).view(5, 2)
    block_table = torch.tensor([2, 0])
    positions = torch.arange(5)
    write_latent(cache, latent, k_pe, block_table[positions // 3] * 3 + positions % 3)
    assert torch.equal(gather_latent(cache, block_table, 5), torch.cat([latent, k_pe], dim=-1))
    assert cache[1].isnan().all() and cache[3].isnan().all()


def test_backend_over_paged_cache_matches_dense_for_prefill_chunks_and_decode(monkeypatch):
    """Two sequences: prefill in two chunks, then two decode steps (absorbed), vs one dense pass each."""
    absorbed_calls = []
    monkeypatch.setattr(mla_attention, "batched_absorbed_decode",
                        lambda *args: absorbed_calls.append(args[0].shape[0]) or batched_absorbed_decode(*args))
    generator = torch.Generator().manual_seed(1)
    heads, nope, rope, v_dim, rank, page = 4, 16, 8, 12, 32, 4
    params = _params(heads, nope, v_dim, rank, generator)
    lens = [9, 6]
    acts = [_activations(n, heads, nope, rope, rank, generator) for n in lens]
    backend, cache = TorchMLAAttention(), torch.zeros(8, page, rank + rope)
    block_tables = torch.tensor([[0, 1, 2], [5, 6, 0]])
    dense = [backend.forward(*a, None, AttentionMetadata.dense([n]), params) for a, n in zip(acts, lens)]
    steps = [[(0, 4), (0, 3)], [(4, 7), (3, 4)], [(7, 8), (4, 5)], [(8, 9), (5, 6)]]
    outputs = [[], []]
    for step in steps:
        rows = [tuple(x[s:e] for x in a) for a, (s, e) in zip(acts, step)]
        batch = [torch.cat([r[i] for r in rows]) for i in range(4)]
        positions = torch.cat([torch.arange(s, e) for s, e in step])
        seq = torch.cat([torch.full((e - s,), b) for b, (s, e) in enumerate(step)])
        starts = [0, step[0][1] - step[0][0], sum(e - s for s, e in step)]
        meta = AttentionMetadata(starts, [e for _, e in step], block_tables,
                                 block_tables[seq, positions // page] * page + positions % page, page)
        out = backend.forward(*batch, cache, meta, params)
        for b in range(2):
            outputs[b].append(out[starts[b]:starts[b + 1]])
    for b in range(2):
        torch.testing.assert_close(torch.cat(outputs[b]), dense[b], atol=1e-5, rtol=1e-5)
    # one batched call per step with a 1-token continuation: sequence 1 in step 2, both in steps 3 and 4
    assert absorbed_calls == [1, 2, 2]


@pytest.mark.parametrize("heads,nope,rope,v_dim,rank", [(1, 4, 2, 4, 8), (4, 16, 8, 12, 32)])
def test_batched_absorbed_decode_equals_per_sequence_reference(heads, nope, rope, v_dim, rank):
    """Ragged contexts over scattered, shared-padding pages (NaN where nothing was written) in one call."""
    generator = torch.Generator().manual_seed(heads + rank)
    params = _params(heads, nope, v_dim, rank, generator)
    page, lens = 4, [1, 9, 4, 13]
    cache = torch.full((12, page, rank + rope), float("nan"))
    block_tables = torch.tensor([[3, 0, 0, 0], [7, 1, 10, 0], [2, 0, 0, 0], [4, 5, 6, 11]])
    for b, length in enumerate(lens):
        positions = torch.arange(length)
        _, _, latent, k_pe = _activations(length, heads, nope, rope, rank, generator)
        write_latent(cache, latent, k_pe, block_tables[b, positions // page] * page + positions % page)
    q_nope, q_pe, _, _ = _activations(len(lens), heads, nope, rope, rank, generator)
    batched = batched_absorbed_decode(q_nope, q_pe, cache, block_tables, torch.tensor(lens), params)
    for b, length in enumerate(lens):
        expected = absorbed_attention(q_nope[b:b + 1], q_pe[b:b + 1], gather_latent(cache, block_tables[b], length),
                                      params)
        torch.testing.assert_close(batched[b:b + 1], expected, atol=1e-5, rtol=1e-5)


def test_batch_mixing_a_new_sequence_a_continued_chunk_and_decode_tokens_matches_dense():
    """One step holding every path of the backend: wholly new (decompressed together), a chunk after cached
    context (read back), two decode tokens (absorbed, batched); each equals its sequence's dense pass."""
    generator = torch.Generator().manual_seed(5)
    heads, nope, rope, v_dim, rank, page = 4, 16, 8, 12, 32, 4
    params = _params(heads, nope, v_dim, rank, generator)
    lens, cached = [7, 5, 9, 6], [6, 0, 4, 5]  # sequence 1 is new, 2 continues with 5 tokens, 0 and 3 decode
    acts = [_activations(n, heads, nope, rope, rank, generator) for n in lens]
    backend, cache = TorchMLAAttention(), torch.full((16, page, rank + rope), float("nan"))
    block_tables = torch.tensor([[0, 1, 0], [2, 3, 0], [4, 5, 6], [7, 8, 0]])

    def slots(b, s, e):
        positions = torch.arange(s, e)
        return block_tables[b, positions // page] * page + positions % page

    for b, n in enumerate(cached):  # the cached context, written as a previous step would have
        if n:
            write_latent(cache, acts[b][2][:n], acts[b][3][:n], slots(b, 0, n))
    batch = [torch.cat([a[i][c:] for a, c in zip(acts, cached)]) for i in range(4)]
    starts = [0]
    for n, c in zip(lens, cached):
        starts.append(starts[-1] + n - c)
    meta = AttentionMetadata(starts, lens, block_tables,
                             torch.cat([slots(b, c, n) for b, (n, c) in enumerate(zip(lens, cached))]), page)
    out = backend.forward(*batch, cache, meta, params)
    for b, (n, c) in enumerate(zip(lens, cached)):
        dense = backend.forward(*acts[b], None, AttentionMetadata.dense([n]), params)
        torch.testing.assert_close(out[starts[b]:starts[b + 1]], dense[c:], atol=1e-5, rtol=1e-5)

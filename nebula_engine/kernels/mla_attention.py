"""Multi-head latent attention (DeepSeek-V2) over a paged latent cache: backends and torch reference.

Legend: T = new tokens in the batch, H = heads, R = kv_lora_rank, Dn = qk_nope_head_dim, Dr = qk_rope_head_dim,
Dv = v_head_dim, L = context tokens of one sequence, P = pages, S = page size.

Latent cache of one layer: ``[P, S, R + Dr]``, each token's normed latent c̃ followed by its rotated k_pe
(shared by all heads); slots as in ``kernels.attention``. ``kv_b`` [H, Dn + Dv, R] is ``kv_b_proj.weight``
viewed per head: rows ``:Dn`` are W_UK (k_nope_h = W_UK,h c̃), rows ``Dn:`` are W_UV (v_h = W_UV,h c̃).

Two exact rewrites of the same attention, chosen per sequence by the backend:
- decompressed: K_h = [W_UK,h c̃; k_pe], V_h = W_UV,h c̃ per context token, then causal attention. Prefill
  chunks use it: with many queries, decompressing L tokens once is cheaper than absorbing into each query.
- absorbed: q_lat,h = W_UK,hᵀ q_nope,h makes scores = scale·(q_lat,h·c̃ + q_pe,h·k_pe), MQA with one
  (R + Dr)-wide key per token that *is* the cache row; o_h = W_UV,h Σ p c̃. Decode uses it: nothing of
  the L-token context is decompressed, so a step reads R + Dr values per token instead of H·(D + Dv).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nebula_engine.kernels.attention import AttentionMetadata, causal_attention


@dataclass(frozen=True)
class MLAParams:
    """What attention needs of an MLA layer beyond its activations."""

    kv_b: torch.Tensor  # [H, Dn + Dv, R]
    nope_dim: int  # Dn
    scale: float

    @property
    def w_uk(self) -> torch.Tensor:  # [H, Dn, R]
        return self.kv_b[:, : self.nope_dim]

    @property
    def w_uv(self) -> torch.Tensor:  # [H, Dv, R]
        return self.kv_b[:, self.nope_dim:]


class MLAAttentionBackend(ABC):
    """Writes each new token's (c̃, k_pe) into the latent cache and attends every new token causally."""

    name: str

    @abstractmethod
    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, Dn]
        q_pe: torch.Tensor,  # [T, H, Dr], rotated
        latent: torch.Tensor,  # [T, R] normed c̃ of the new tokens
        k_pe: torch.Tensor,  # [T, Dr], rotated
        cache: torch.Tensor | None,  # [P, S, R + Dr]; None => no cache, every sequence wholly new
        meta: AttentionMetadata,
        params: MLAParams,
    ) -> torch.Tensor:  # [T, H, Dv]
        ...


def write_latent(cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    rows = torch.cat([latent, k_pe], dim=-1).to(cache.dtype)  # [T, R + Dr]
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, rows)


def gather_latent(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cache rows of one sequence, contiguous [L, R + Dr]."""
    page_size = cache.shape[1]
    pages = block_table[: (length + page_size - 1) // page_size]
    return cache.index_select(0, pages).flatten(0, 1)[:length]


def decompress(latent: torch.Tensor, k_pe: torch.Tensor, params: MLAParams) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [L, R], k_pe [L, Dr] -> K [L, H, Dn + Dr] (= [W_UK,h c̃; k_pe]), V [L, H, Dv] (= W_UV,h c̃)."""
    heads, nope = params.kv_b.shape[0], params.nope_dim
    kv = F.linear(latent, params.kv_b.flatten(0, 1)).view(latent.shape[0], heads, -1)  # [L, H, Dn + Dv]
    return torch.cat([kv[..., :nope], k_pe[:, None, :].expand(-1, heads, -1)], dim=-1), kv[..., nope:]


def decompressed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                           params: MLAParams, q_positions: torch.Tensor | None = None) -> torch.Tensor:
    """q [Lq, H, ·] are the last Lq tokens of the L-token context latent [L, R], k_pe [L, Dr] -> [Lq, H, Dv].

    ``q_positions`` [Lq]: the queries sit at these context positions instead (PIC partial recompute)."""
    k, v = decompress(latent, k_pe, params)
    return causal_attention(torch.cat([q_nope, q_pe], dim=-1), k, v, params.scale, q_positions=q_positions)


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor,
                       params: MLAParams) -> torch.Tensor:
    """Same contract as ``decompressed_attention`` over cache rows [L, R + Dr] (= [c̃; k_pe]) as they are stored."""
    rank = params.kv_b.shape[-1]
    q_lat = torch.einsum("thn,hnr->thr", q_nope, params.w_uk.to(q_nope.dtype))  # [Lq, H, R]
    keys = rows.to(q_nope.dtype)[:, None, :]  # [L, 1, R + Dr]: one key head shared by every query head
    o_lat = causal_attention(torch.cat([q_lat, q_pe], dim=-1), keys, keys[..., :rank], params.scale)  # [Lq, H, R]
    return torch.einsum("thr,hvr->thv", o_lat, params.w_uv.to(q_nope.dtype))


def batched_absorbed_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, params: MLAParams) -> torch.Tensor:
    """One new token per sequence: q_nope [B, H, Dn], q_pe [B, H, Dr] over each sequence's first ``seq_lens[b]``
    cache rows (pages ``block_tables[b]``) -> [B, H, Dv]; ``absorbed_attention`` for the whole batch at once.

    Contexts are read as [B, Lmax, R + Dr] (one page gather); rows past a sequence's length are zeroed (the pool
    is uninitialised memory) and masked out of the softmax. W_UK and W_UV are applied as one batched matmul
    over heads each.
    """
    rank, page_size, max_len = params.kv_b.shape[-1], cache.shape[1], int(seq_lens.max())
    pages = block_tables[:, : -(-max_len // page_size)]
    rows = cache[pages].flatten(1, 2)[:, :max_len].to(q_nope.dtype)  # [B, Lmax, R + Dr]
    valid = torch.arange(max_len, device=rows.device) < seq_lens[:, None]  # [B, Lmax]
    rows = rows.masked_fill(~valid[..., None], 0.0)
    q_lat = torch.bmm(q_nope.transpose(0, 1), params.w_uk.to(q_nope.dtype))  # [H, B, R]
    query = torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1) * params.scale  # [B, H, R + Dr]
    scores = torch.bmm(query, rows.transpose(1, 2)).masked_fill_(~valid[:, None, :], float("-inf"))  # [B, H, Lmax]
    probs = scores.float().softmax(dim=-1).to(q_nope.dtype)
    o_lat = torch.bmm(probs, rows[..., :rank])  # [B, H, R]
    return torch.bmm(o_lat.transpose(0, 1), params.w_uv.to(q_nope.dtype).transpose(1, 2)).transpose(0, 1)


class TorchMLAAttention(MLAAttentionBackend):
    """Reference backend: scatter rows into pages; every decode token of the batch in one absorbed call, the new
    tokens of wholly new sequences decompressed in one matmul, other prefill chunks decompressed per sequence."""

    name = "torch"

    def forward(self, q_nope, q_pe, latent, k_pe, cache, meta, params):
        if cache is not None and meta.slot_mapping is not None:
            write_latent(cache, latent, k_pe, meta.slot_mapping)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], params.kv_b.shape[1] - params.nope_dim)
        starts, rank = meta.query_start_loc, params.kv_b.shape[-1]
        decoding, fresh, continuing = self._partition(cache, meta)
        if decoding:
            self._decode(q_nope, q_pe, cache, meta, params, decoding, out)
        if fresh:
            self._prefill_fresh(q_nope, q_pe, latent, k_pe, meta, params, fresh, out)
        for b in continuing:  # a prefill chunk after cached context, or PIC's scattered recompute rows
            start, end = starts[b], starts[b + 1]
            rows = gather_latent(cache, meta.block_tables[b], meta.seq_lens[b])
            ctx_latent, ctx_k_pe = rows.to(latent.dtype).split([rank, k_pe.shape[-1]], dim=-1)
            q_positions = meta.query_positions[start:end] if meta.query_positions is not None else None
            out[start:end] = decompressed_attention(q_nope[start:end], q_pe[start:end], ctx_latent, ctx_k_pe,
                                                    params, q_positions)
        return out

    @staticmethod
    def _partition(cache, meta) -> tuple[list[int], list[int], list[int]]:
        """Sequences whose one new token continues a cached context (absorbed decode), wholly new sequences
        (nothing to read from the cache) and the rest (cached context read back and decompressed)."""
        decoding, fresh, continuing = [], [], []
        for b in range(meta.num_seqs):
            q_len = meta.query_start_loc[b + 1] - meta.query_start_loc[b]
            if meta.query_positions is not None:
                continuing.append(b)
            elif cache is None or q_len == meta.seq_lens[b]:
                fresh.append(b)
            else:
                (decoding if q_len == 1 else continuing).append(b)
        return decoding, fresh, continuing

    @staticmethod
    def _decode(q_nope, q_pe, cache, meta, params, decoding, out) -> None:
        if len(decoding) == meta.num_seqs:  # a pure decode batch: token b is sequence b
            out[:] = batched_absorbed_decode(q_nope, q_pe, cache, meta.block_tables,
                                             torch.tensor(meta.seq_lens, device=cache.device), params)
            return
        index = torch.tensor(decoding, device=q_nope.device)
        tokens = torch.tensor([meta.query_start_loc[b] for b in decoding], device=q_nope.device)
        seq_lens = torch.tensor([meta.seq_lens[b] for b in decoding], device=q_nope.device)
        out[tokens] = batched_absorbed_decode(q_nope[tokens], q_pe[tokens], cache, meta.block_tables[index],
                                              seq_lens, params)

    @staticmethod
    def _prefill_fresh(q_nope, q_pe, latent, k_pe, meta, params, fresh, out) -> None:
        """Causal attention of each wholly new sequence over itself; K/V of all of them from one decompression."""
        starts = meta.query_start_loc
        if len(fresh) == meta.num_seqs:
            k, v = decompress(latent, k_pe, params)
            q, spans = torch.cat([q_nope, q_pe], dim=-1), [(starts[b], starts[b + 1]) for b in fresh]
        else:
            rows = torch.cat([torch.arange(starts[b], starts[b + 1], device=q_nope.device) for b in fresh])
            k, v = decompress(latent[rows], k_pe[rows], params)
            q, spans, offset = torch.cat([q_nope[rows], q_pe[rows]], dim=-1), [], 0
            for b in fresh:
                spans.append((offset, offset + starts[b + 1] - starts[b]))
                offset = spans[-1][1]
        for b, (lo, hi) in zip(fresh, spans):
            out[starts[b]:starts[b + 1]] = causal_attention(q[lo:hi], k[lo:hi], v[lo:hi], params.scale)


_BACKENDS: dict[str, type[MLAAttentionBackend]] = {"torch": TorchMLAAttention}


def get_mla_backend(name: str = "torch") -> MLAAttentionBackend:
    """The MLA backend registered under the same name users give ``--attention-backend``."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown MLA attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def mla_backend_for(attention_backend: str) -> MLAAttentionBackend:
    """The MLA backend paired with an attention backend: the one of the same name, else the torch reference."""
    return get_mla_backend(attention_backend if attention_backend in _BACKENDS else "torch")

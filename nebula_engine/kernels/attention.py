"""Attention over a paged KV cache: the contract between model layers and the engine.

Legend: T = tokens in the flattened batch, B = sequences, H = query heads, Hkv = KV heads,
D = q/k head dim, Dv = v head dim, P = pages in the pool, S = page size (tokens per page).

A batch is the concatenation of every sequence's *new* tokens (prefill chunk or one decode
token). Sequence b owns rows ``query_start_loc[b]:query_start_loc[b+1]``; its new tokens sit at
the end of its context of ``seq_lens[b]`` tokens, earlier tokens already live in the cache.

KV cache of one full-attention layer: ``k_cache [P, S, Hkv, D]`` and ``v_cache [P, S, Hkv, Dv]``.
K is stored post-RoPE. Token slot ``page * S + offset`` holds the token at ``offset`` of that page.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from nebula_engine.kernels import cpu_paged_decode

if TYPE_CHECKING:  # mla_attention builds on this module
    from nebula_engine.kernels.mla_attention import MLAAttentionBackend, MLAParams
    from nebula_engine.model.rotary import RotaryEmbedding


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: list[int]  # [B+1] offsets of each sequence's new tokens in the batch
    seq_lens: list[int]  # [B] context length including this step's new tokens
    block_tables: torch.Tensor | None  # [B, max_pages] int64 page ids; None => no cache
    slot_mapping: torch.Tensor | None  # [T] int64 flat slot each new token's K/V is written to
    page_size: int = 0
    # [T] absolute position of each new token, given only when new tokens are NOT the last ones of their
    # context (PIC combine prefill recomputes a scattered set of rows): token i then sees keys j <= position i
    query_positions: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @cached_property
    def page_runs(self) -> list[list[tuple[int, int]]]:
        """Per sequence, its context pages as runs ``(first page id, num pages)`` of consecutive ids."""
        return [_consecutive_runs(row[: -(-length // self.page_size)])
                for row, length in zip(self.block_tables.tolist(), self.seq_lens)]

    @cached_property
    def context_plans(self) -> list[ContextPlan]:
        """Per sequence, how to read its cached context; built once per forward, shared by every layer."""
        return [ContextPlan.of(runs, length, self.page_size, self.block_tables.device)
                for runs, length in zip(self.page_runs, self.seq_lens)]

    @cached_property
    def decode_batch(self) -> DecodeBatch | None:
        """The sequences that add one token to a cached context, as one batch; built once per forward."""
        if self.block_tables is None or self.query_positions is not None:
            return None
        starts = self.query_start_loc
        seqs = [b for b in range(self.num_seqs) if starts[b + 1] - starts[b] == 1 and self.seq_lens[b] > 1]
        return DecodeBatch.of(self, seqs) if seqs else None

    @classmethod
    def dense(cls, query_lens: Sequence[int]) -> AttentionMetadata:
        """Cache-less metadata: each sequence is wholly new and attends causally to itself."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return cls(query_start_loc=starts, seq_lens=list(query_lens), block_tables=None, slot_mapping=None)


def _consecutive_runs(pages: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


class AttentionBackend(ABC):
    """Writes the new K/V into the cache and computes causal attention for every new token."""

    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, Dv]
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # a query sees only the last ``sliding_window`` keys, itself included
    ) -> torch.Tensor:  # [T, H, Dv]
        ...


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` tokens of one sequence as contiguous [L, Hkv, D] / [L, Hkv, Dv]."""
    page_size = k_cache.shape[1]
    pages = block_table[: (length + page_size - 1) // page_size]
    k = k_cache.index_select(0, pages).flatten(0, 1)[:length]
    v = v_cache.index_select(0, pages).flatten(0, 1)[:length]
    return k, v


MIN_VIEW_PAGES = 4  # shorter page runs are gathered together: a matmul per tiny run costs more


@dataclass(frozen=True)
class ContextPlan:
    """How to read one sequence's cached context: long page runs in place as views, the pages of
    short runs gathered into one piece. Attention does not depend on key order, only on K and V
    pieces aligning."""

    views: tuple[tuple[int, int, int], ...]  # (first page, num pages, tokens) of each long run
    gathered_pages: torch.Tensor | None  # page ids of the short runs, in order
    gathered_tokens: int

    @classmethod
    def of(cls, runs: list[tuple[int, int]], length: int, page_size: int, device) -> ContextPlan:
        views, short_pages, short_tokens, remaining = [], [], 0, length
        for first, count in runs:
            tokens = min(count * page_size, remaining)
            remaining -= tokens
            if count >= MIN_VIEW_PAGES:
                views.append((first, count, tokens))
            else:  # only the context's last page can be partial, and it stays last among the short pages
                short_pages.extend(range(first, first + count))
                short_tokens += tokens
        pages = torch.tensor(short_pages, device=device) if short_pages else None
        return cls(tuple(views), pages, short_tokens)

    def chunks(self, cache: torch.Tensor) -> list[torch.Tensor]:
        """The context as [L_i, Hkv, D] pieces of ``cache`` [P, S, Hkv, D]."""
        pieces = [cache[first: first + count].flatten(0, 1)[:tokens] for first, count, tokens in self.views]
        if self.gathered_pages is not None:
            pieces.append(cache.index_select(0, self.gathered_pages).flatten(0, 1)[: self.gathered_tokens])
        return pieces


@dataclass(frozen=True)
class DecodeBatch:
    """Decode sequences of a batch, read together: one attention call per layer for all of them instead of a
    Python loop over sequences (vLLM's paged decode kernel does the same in one launch).

    On CPU in fp32 the C++ kernel of ``cpu_paged_decode`` reads each sequence's pages in place. Elsewhere one gather
    copies the contexts out, padded to the longest one, and one SDPA call reads them: a padded key repeats the
    sequence's own last token and the mask hides it. Slots the sequence never wrote (a page's unused tail, a fresh
    pool's garbage, another request's leftovers) are never read, since -inf plus a NaN read from them would still be
    NaN.
    """

    seqs: list[int]  # indices of the decode sequences in the batch
    rows: torch.Tensor  # [Bd] their query row in the batch's tokens
    block_tables: torch.Tensor  # [Bd, max_pages] their page ids
    seq_lens: torch.Tensor  # [Bd] context lengths
    max_len: int
    page_size: int
    covers_batch: bool  # every row of the batch is a decode row, in order
    _masks: dict[tuple[int | None, torch.dtype], torch.Tensor] = field(default_factory=dict, compare=False,
                                                                      repr=False)

    @classmethod
    def of(cls, meta: AttentionMetadata, seqs: list[int]) -> DecodeBatch:
        device = meta.block_tables.device
        lengths = torch.tensor([meta.seq_lens[b] for b in seqs], device=device)
        tables = meta.block_tables if len(seqs) == meta.num_seqs else \
            meta.block_tables.index_select(0, torch.tensor(seqs, device=device))
        rows = torch.tensor([meta.query_start_loc[b] for b in seqs], device=device)
        return cls(seqs, rows, tables, lengths, max(meta.seq_lens[b] for b in seqs), meta.page_size,
                   len(seqs) == meta.query_start_loc[-1])

    @cached_property
    def slots(self) -> torch.Tensor:
        """[Bd * Lmax] cache slot of each (sequence, context position), padding clamped to the last token."""
        positions = torch.minimum(torch.arange(self.max_len, device=self.seq_lens.device)[None, :],
                                  self.seq_lens[:, None] - 1)  # [Bd, Lmax]
        pages = self.block_tables.gather(1, positions // self.page_size)
        return (pages * self.page_size + positions % self.page_size).flatten()

    def mask(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[Bd, 1, 1, Lmax]: 0 at the keys each query sees, -inf elsewhere (built once per forward and window)."""
        key = (sliding_window, dtype)
        if key in self._masks:
            return self._masks[key]
        keys = torch.arange(self.max_len, device=self.seq_lens.device)[None, :]
        visible = keys < self.seq_lens[:, None]
        if sliding_window is not None:
            visible &= keys >= self.seq_lens[:, None] - sliding_window
        # additive in the queries' dtype: SDPA would convert a bool mask in every layer
        additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
        self._masks[key] = additive[:, None, None, :]
        return self._masks[key]

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               sliding_window: int | None = None) -> torch.Tensor:
        """q [Bd, H, D] (one token per sequence) -> [Bd, H, Dv]."""
        if cpu_paged_decode.usable(q, k_cache, v_cache):
            return cpu_paged_decode.paged_decode(q, k_cache, v_cache, self.block_tables, self.seq_lens, scale,
                                                 sliding_window)
        batch = q.shape[0]
        # [Bd, Hkv, Lmax, D] as a view of the gathered slots: SDPA takes the strides as they are
        keys = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, self.slots)
        values = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, self.slots)
        keys = keys.view(batch, self.max_len, *k_cache.shape[2:]).transpose(1, 2)
        values = values.view(batch, self.max_len, *v_cache.shape[2:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=self.mask(sliding_window, q.dtype),
                                             scale=scale, enable_gqa=keys.shape[1] != q.shape[1])
        return out[:, :, 0]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: ContextPlan,
                     scale: float) -> torch.Tensor:
    """One query token q [1, H, D] over a sequence's cached context, read as ``plan`` says.

    Copying the context out of the pages costs as much as attending over it, so consecutive page
    runs are read in place as views; scores [Hkv, G, L] are concatenated and softmaxed once.
    """
    num_kv_heads = k_cache.shape[2]
    q_grouped = q[0].view(num_kv_heads, -1, q.shape[-1]) * scale  # [Hkv, G, D], G = H / Hkv
    keys, values = plan.chunks(k_cache), plan.chunks(v_cache)
    scores = torch.cat([torch.matmul(q_grouped, key.permute(1, 2, 0)) for key in keys], dim=-1)
    probs = scores.float().softmax(dim=-1).to(q.dtype)  # [Hkv, G, L]
    out, offset = None, 0
    for value in values:
        part = torch.matmul(probs[..., offset: offset + value.shape[0]], value.transpose(0, 1))
        out = part if out is None else out + part
        offset += value.shape[0]
    return out.reshape(1, q.shape[1], -1)  # [1, H, Dv]


# rows of a scattered-row (PIC) query per block: each block attends to the keys all its rows see without a mask, and
# with one to the few between its first and last row's positions. tools/bench_attention_split.py, 720 rows over 2,730
# keys against one masked call: 1.84x at 32 rows a block and 1.86x at 64 (one thread), 1.57x and 1.42x (two threads);
# 8 rows 1.25x, 256 rows 1.54x
SPLIT_BLOCK_ROWS = 32


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     sliding_window: int | None = None, q_positions: torch.Tensor | None = None) -> torch.Tensor:
    """q [Lq, H, D] are the last Lq tokens of the Lk-token context k [Lk, Hkv, D], v [Lk, Hkv, Dv].

    With ``sliding_window`` W, the query at position i sees keys i-W < j <= i (transformers' convention).
    ``q_positions`` [Lq]: the queries sit at these context positions instead (the exact per-row causal mask
    of PIC's partial recompute).
    """
    lq, lk = q.shape[0], k.shape[0]
    if lq == 0:  # nothing to attend for (torch's CPU flash kernel divides by zero on an empty query)
        return q.new_empty(0, q.shape[1], v.shape[-1])
    windowed = sliding_window is not None and lk > sliding_window
    # [1, H, L, D]: the 4-D layout takes SDPA's fused kernels; enable_gqa shares K/V across heads without copies
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = kh.shape[1] != qh.shape[1]
    if q_positions is None and lq == lk and not windowed:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    elif q_positions is None and lq == 1 and not windowed:
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=gqa)
    elif sliding_window is None and _splits(qh, kh, vh):
        out = _split_causal_attention(qh, kh, vh, scale, q_positions)
    elif q_positions is not None:
        keys = torch.arange(lk, device=q.device)
        mask = keys[None, :] <= q_positions[:, None]
        if sliding_window is not None:
            mask &= keys[None, :] > q_positions[:, None] - sliding_window
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    else:
        # query i sits at absolute position lk - lq + i and sees keys 0..lk-lq+i (the last W of them if windowed)
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        if windowed:
            mask &= torch.ones_like(mask).triu(lk - lq - sliding_window + 1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def _splits(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> bool:
    """Whether ``_split_causal_attention`` can run: torch's CPU flash kernel, which returns the log-sum-exp."""
    return (qh.device.type == "cpu" and qh.dtype in (torch.float32, torch.bfloat16) and kh.dtype == qh.dtype
            and vh.shape[-1] == qh.shape[-1] and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _flash_with_lse(q, k, v, scale, is_causal=False, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """out [1, H, Lq, Dv] and its log-sum-exp [1, H, Lq] (GQA without copies)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=is_causal, attn_mask=mask,
                                                                        scale=scale)[:2]


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over the union of disjoint key sets, from each set's output and log-sum-exp."""
    if len(parts) == 1:
        return parts[0][0]
    lse = torch.stack([p[1] for p in parts]).float()  # [n, 1, H, Lq]
    weights = (lse - lse.max(dim=0).values).exp()
    weights = weights / weights.sum(dim=0)
    out = sum(p[0].float() * w[..., None] for p, w in zip(parts, weights))
    return out.to(parts[0][0].dtype)


def _split_causal_attention(qh, kh, vh, scale: float, q_positions: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of queries that sit at the end of the context (or at ``q_positions``, ascending) without an
    [Lq, Lk] mask: SDPA with a mask computes every block of it, so the keys are split where no mask is needed.

    Queries at the end: all of them see the keys before the first query unmasked, and the last Lq keys causally (a
    square, top-left aligned, as ``is_causal`` means). Scattered rows: per block of ``SPLIT_BLOCK_ROWS`` rows, the
    keys up to the block's first position unmasked, then those up to its last position with a mask. The parts
    merge exactly through their log-sum-exps (at 1,800 queries over 2,648 keys, 8 heads of 32, one thread: 46 ms
    against 82-86 ms with the mask; ``tools/bench_attention_split.py``)."""
    lq, lk = qh.shape[2], kh.shape[2]
    if q_positions is None:
        prefix = lk - lq
        parts = [_flash_with_lse(qh, kh[:, :, prefix:], vh[:, :, prefix:], scale, is_causal=True)]
        if prefix:
            parts.append(_flash_with_lse(qh, kh[:, :, :prefix], vh[:, :, :prefix], scale))
        return _merge(parts)
    positions = q_positions.tolist()
    if any(later < earlier for earlier, later in zip(positions, positions[1:])):  # not ascending: one masked call
        keys = torch.arange(lk, device=qh.device)
        mask = torch.zeros(lq, lk, dtype=qh.dtype, device=qh.device).masked_fill_(
            keys[None, :] > q_positions[:, None], float("-inf"))
        return _flash_with_lse(qh, kh, vh, scale, mask=mask)[0]
    blocks = []
    for start in range(0, lq, SPLIT_BLOCK_ROWS):
        rows = slice(start, min(start + SPLIT_BLOCK_ROWS, lq))
        first, last = positions[rows.start], positions[rows.stop - 1]
        q_block = qh[:, :, rows]
        parts = [_flash_with_lse(q_block, kh[:, :, : first + 1], vh[:, :, : first + 1], scale)]  # seen by every row
        if last > first:  # keys first+1..last: row i sees those up to its position; rows at `first` see none
            block_positions = q_positions[rows]
            keys = torch.arange(first + 1, last + 1, device=qh.device)
            hidden = keys[None, :] > block_positions[:, None]
            mask = torch.zeros(hidden.shape, dtype=qh.dtype, device=qh.device).masked_fill_(hidden, float("-inf"))
            out, lse = _flash_with_lse(q_block, kh[:, :, first + 1: last + 1], vh[:, :, first + 1: last + 1], scale,
                                       mask=mask)
            # the CPU kernel gives a row that sees no key of a part output 0 and log-sum-exp 0: weigh it out
            lse = lse.masked_fill((block_positions <= first)[None, None, :], float("-inf"))
            parts.append((out, lse))
        blocks.append(_merge(parts))
    return torch.cat(blocks, dim=2)


class TorchPagedAttention(AttentionBackend):
    """Reference backend: scatter new K/V into pages; decode rows of several sequences in one batched call
    (one sequence alone reads its pages in place), prefill gathers + SDPA per sequence."""

    name = "torch"

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window=None):
        if kv_cache is not None and meta.slot_mapping is not None:
            write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        decode = meta.decode_batch if kv_cache is not None else None
        # one sequence alone reads its pages in place through ContextPlan views unless the kernel does it
        if decode is not None and (len(decode.seqs) > 1 or cpu_paged_decode.usable(q, kv_cache[0], kv_cache[1])):
            batched = decode.attend(q if decode.covers_batch else q.index_select(0, decode.rows),
                                    kv_cache[0], kv_cache[1], scale, sliding_window)
            if decode.covers_batch:
                return batched
            out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
            out.index_copy_(0, decode.rows, batched)
            done = set(decode.seqs)
        else:
            out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
            done = set()
        for b in range(meta.num_seqs):
            if b in done:
                continue
            start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            q_len, ctx_len = end - start, meta.seq_lens[b]
            if meta.query_positions is not None:
                kb, vb = gather_kv(kv_cache[0], kv_cache[1], meta.block_tables[b], ctx_len)
                out[start:end] = causal_attention(q[start:end], kb, vb, scale, sliding_window,
                                                  meta.query_positions[start:end])
                continue
            if q_len == ctx_len or kv_cache is None:
                kb, vb = k[start:end], v[start:end]
            elif q_len == 1 and (sliding_window is None or ctx_len <= sliding_window):
                out[start:end] = decode_attention(q[start:end], kv_cache[0], kv_cache[1],
                                                  meta.context_plans[b], scale)
                continue
            else:
                kb, vb = gather_kv(kv_cache[0], kv_cache[1], meta.block_tables[b], ctx_len)
            out[start:end] = causal_attention(q[start:end], kb, vb, scale, sliding_window)
        return out


_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchPagedAttention}


def resolve_attention_backend(name: str, device: torch.device | str) -> str:
    """``auto``: FlashInfer when the engine runs on CUDA and flashinfer imports, else the torch reference."""
    if name != "auto":
        return name
    if torch.device(device).type == "cuda":
        try:
            import flashinfer  # noqa: F401  (a capability probe)
        except ImportError:
            return "torch"
        return "flashinfer"
    return "torch"


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    if name == "flashinfer":  # CUDA only; imported on demand (it builds on this module)
        from nebula_engine.kernels.flashinfer_backend import FlashInferAttention

        return FlashInferAttention()
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS) + ['flashinfer']}")
    return _BACKENDS[name]()


@dataclass
class AttentionContext:
    """What one forward pass hands to every attention layer: backend, metadata, per-layer caches.

    Full-attention layers call ``attend`` (K/V caches); MLA layers call ``attend_latent`` (latent caches,
    one [P, S, R + Dr] tensor per layer, served by ``mla_backend``).
    """

    backend: AttentionBackend
    meta: AttentionMetadata
    kv_caches: Sequence[tuple[torch.Tensor, ...]] | None = None
    mla_backend: MLAAttentionBackend | None = None
    # rotary cache key -> (positions, cos, sin): computed by the first layer of a forward, reused by the others
    _rope: dict = field(default_factory=dict, repr=False)

    def rope_cos_sin(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary.cos_sin(positions)``, computed once per forward for all layers with the same frequencies."""
        cached = self._rope.get(rotary.cache_key)
        if cached is None or cached[0] is not positions:  # the reference held keeps ``positions``' id unique
            cached = self._rope[rotary.cache_key] = (positions, *rotary.cos_sin(positions))
        return cached[1], cached[2]

    def attend(self, layer_idx: int, q, k, v, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        cache = self.kv_caches[layer_idx] if self.kv_caches is not None else None
        return self.backend.forward(q, k, v, cache, self.meta, scale, sliding_window)

    def attend_latent(self, layer_idx: int, q_nope, q_pe, latent, k_pe, params: MLAParams) -> torch.Tensor:
        """MLA: q_nope [T, H, Dn], q_pe [T, H, Dr], c̃ [T, R], k_pe [T, Dr] -> [T, H, Dv] (see mla_attention)."""
        if self.mla_backend is None:
            raise ValueError("an MLA layer needs AttentionContext.mla_backend (kernels.mla_attention.get_mla_backend)")
        cache = self.kv_caches[layer_idx][0] if self.kv_caches is not None else None
        return self.mla_backend.forward(q_nope, q_pe, latent, k_pe, cache, self.meta, params)

    @classmethod
    def dense(cls, query_lens: Sequence[int]) -> AttentionContext:
        from nebula_engine.kernels.mla_attention import TorchMLAAttention  # imported here: it imports this module

        return cls(TorchPagedAttention(), AttentionMetadata.dense(query_lens), mla_backend=TorchMLAAttention())

"""The ``flashinfer`` attention backend: FlashInfer's paged prefill/decode kernels over our KV cache layout.

Our pool is FlashInfer's "NHD" paged layout as is: ``k_cache [P, S, Hkv, D]`` and ``v_cache [P, S, Hkv, Dv]``
are passed as the tuple ``(k_cache, v_cache)``; a sequence's pages are the first ceil(seq_len / S) ids of its
block table row (CSR ``indptr``/``indices`` plus ``last_page_len`` in [1, S]). Semantics equal
``TorchPagedAttention``: new tokens are the last of their context (bottom-right causal), or sit at
``meta.query_positions`` (PIC combine prefill: an exact per-row mask passed as FlashInfer's custom mask);
a sliding window W sees keys i-W < j <= i, FlashInfer's ``window_left = W - 1``.

FlashInfer plans once per batch shape: a wrapper is planned on the first layer that calls with a given
metadata object and reused by every later layer with the same (heads, dims, scale, window, dtypes).
flashinfer is imported lazily; constructing the backend without CUDA or without flashinfer raises RuntimeError.
FlashInfer runs fp16/bf16 only.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from nebula_engine.kernels.attention import AttentionBackend, AttentionMetadata, write_kv

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-kv partial results)


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        if not torch.cuda.is_available():
            raise RuntimeError("the 'flashinfer' attention backend needs a CUDA device; use 'torch' here")
        try:
            import flashinfer
        except ImportError as error:
            raise RuntimeError("the 'flashinfer' attention backend needs the flashinfer package: "
                               "pip install 'nebula-engine[gpu]' (flashinfer-python==0.7.4)") from error
        self._flashinfer = flashinfer
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device="cuda")
        self._wrappers: dict[tuple, Any] = {}  # plan key -> wrapper, kept across forwards (they own buffers)
        self._planned_for: dict[tuple, AttentionMetadata] = {}  # plan key -> metadata it is planned for

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window=None):
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"FlashInfer attention runs fp16/bf16, got {q.dtype}")
        if kv_cache is None or meta.block_tables is None:
            return self._dense(q, k, v, meta, scale, sliding_window)
        if meta.slot_mapping is not None:
            write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        return self._wrapper(q, kv_cache, meta, scale, sliding_window).run(q, tuple(kv_cache))

    def _dense(self, q, k, v, meta, scale, sliding_window):
        """No cache: each sequence is wholly new and attends causally to itself."""
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for start, end in itertools.pairwise(meta.query_start_loc):
            out[start:end] = self._flashinfer.single_prefill_with_kv_cache(
                q[start:end], k[start:end], v[start:end], causal=True, kv_layout="NHD", sm_scale=scale,
                window_left=_window_left(sliding_window))
        return out

    def _wrapper(self, q, kv_cache, meta, scale, sliding_window):
        k_cache, v_cache = kv_cache
        positions = getattr(meta, "query_positions", None)
        query_lens = [e - s for s, e in itertools.pairwise(meta.query_start_loc)]
        decode = positions is None and all(n == 1 for n in query_lens) and k_cache.shape[-1] == v_cache.shape[-1]
        key = (decode, q.shape[1], k_cache.shape[2], k_cache.shape[-1], v_cache.shape[-1], k_cache.shape[1],
               float(scale), sliding_window, q.dtype, k_cache.dtype)
        if key not in self._wrappers:
            self._wrappers[key] = self._new_wrapper(decode)
        if self._planned_for.get(key) is not meta:
            self._plan(self._wrappers[key], decode, key, meta, query_lens, positions)
            self._planned_for[key] = meta
        return self._wrappers[key]

    def _new_wrapper(self, decode: bool):
        if decode:  # the tensor-core decode kernel is the prefill one: one JIT module less to build per config
            return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=True)
        return self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")

    def _plan(self, wrapper, decode, key, meta, query_lens, positions) -> None:
        _, heads, kv_heads, head_dim, v_head_dim, page_size, scale, window, q_dtype, kv_dtype = key
        indptr, indices, last_page_len = _paged_layout(meta, self._workspace.device)
        common = dict(sm_scale=scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
        if decode:
            wrapper.plan(indptr, indices, last_page_len, heads, kv_heads, head_dim, page_size,
                         window_left=_window_left(window), **common)
            return
        qo_indptr = torch.tensor(meta.query_start_loc, dtype=torch.int32)
        if positions is None:
            wrapper.plan(qo_indptr, indptr, indices, last_page_len, heads, kv_heads, head_dim, page_size,
                         head_dim_vo=v_head_dim, causal=True, window_left=_window_left(window), **common)
        else:
            mask = _scattered_mask(meta, positions, window, self._workspace.device)
            wrapper.plan(qo_indptr, indptr, indices, last_page_len, heads, kv_heads, head_dim, page_size,
                         head_dim_vo=v_head_dim, custom_mask=mask, **common)


def _window_left(sliding_window: int | None) -> int:
    """Our window W (keys i-W < j <= i) as FlashInfer's inclusive left extent; -1 means unbounded."""
    return -1 if sliding_window is None else sliding_window - 1


def _paged_layout(meta: AttentionMetadata, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table: indptr [B+1] (host), indices [pages] (device), last_page_len [B] (host)."""
    page_size = meta.page_size
    num_pages = [-(-length // page_size) for length in meta.seq_lens]
    indptr = torch.tensor([0, *itertools.accumulate(num_pages)], dtype=torch.int32)
    indices = torch.cat([meta.block_tables[b, :n] for b, n in enumerate(num_pages)])
    last_page_len = torch.tensor([length - (n - 1) * page_size for length, n in zip(meta.seq_lens, num_pages)],
                                 dtype=torch.int32)
    return indptr, indices.to(device=device, dtype=torch.int32), last_page_len


def _scattered_mask(meta: AttentionMetadata, positions: torch.Tensor, window: int | None, device) -> torch.Tensor:
    """Flattened row-major [q_len, kv_len] boolean masks of every sequence: key j visible to the query at p
    iff j <= p (and j > p - W)."""
    masks = []
    for b, (start, end) in enumerate(itertools.pairwise(meta.query_start_loc)):
        keys = torch.arange(meta.seq_lens[b], device=device)
        rows = positions[start:end].to(device)[:, None]
        mask = keys[None, :] <= rows
        if window is not None:
            mask &= keys[None, :] > rows - window
        masks.append(mask.reshape(-1))
    return torch.cat(masks)

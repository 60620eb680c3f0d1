"""Runs the PIC prefill of a step's requests on this engine: segment lookup, scatter prefill, combine prefill.

For a request admitted with its whole prompt's pages (the prefix-cache hit already in them):
1. each PIC segment not covered by the prefix is looked up in the PIC store; a cold one is prefilled alone
   (or behind the request's tokens before its first segment, for a backend with ``context="prefix"``) into
   fresh pages and stored (if the pool has no room it is computed in the combine instead);
2. the cached segments' K/V is copied to the request's slots and re-rotated to its positions;
3. the request's backend runs the combine prefill and returns the last prompt token's hidden state; the
   requests of one step with the same backend run it as one batched forward (``run_many``).
Entries stay locked only while their pages are copied. The request's pages then go to the prefix cache as
any prefill's do, so a later request with the same prefix and PIC backend reuses the combined KV (paper §4.2);
unless every reused token was recomputed, pages from the first reused token on are cached as approximate K/V of
the backend's spec, which no PIC-off request ever matches (``radix_cache``'s provenance).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from nebula_engine.engine.scheduler import ScheduledSequence
from nebula_engine.kernels.attention import AttentionBackend
from nebula_engine.kernels.mla_attention import MLAAttentionBackend
from nebula_engine.kvcache.cache_lock import CacheLock
from nebula_engine.kvcache.cache_store import CacheStore
from nebula_engine.kvcache.pic_store import PICEntry, segment_key
from nebula_engine.kvcache.pool import KVCacheStorage, OutOfPagesError
from nebula_engine.pic.backends.base import PICBackend, SegmentPrefill
from nebula_engine.pic.combine import CachedSegment, CombineResult, CombineRun, place_reused_kv
from nebula_engine.pic.layout import CombineLayout

logger = logging.getLogger(__name__)


@dataclass
class PICStats:
    segment_hits: int = 0
    segment_misses: int = 0  # prefilled alone here (scatter prefill)
    segment_skipped: int = 0  # no room to cache: computed in the combine
    segment_tokens_prefilled: int = 0  # tokens of the segments prefilled here (misses), for this or another peer
    combines: int = 0  # requests combined
    combine_forwards: int = 0  # forwards that ran them (a step's requests with one backend share one)


@dataclass(frozen=True)
class _Prepared:
    """A request ready for its combine forward: its reused K/V placed in its pages."""

    run: CombineRun
    num_hit_tokens: int  # reused tokens whose segment K/V existed before this request


class PICExecutor:
    def __init__(self, model: nn.Module, storage: KVCacheStorage, cache: CacheStore,
                 attention_backend: AttentionBackend, mla_backend: MLAAttentionBackend | None, model_id: str,
                 bos_token_id: int | None, cache_lock: CacheLock | None = None):
        """``cache_lock``: the engine's, let go of while a forward writes only pages this executor holds."""
        self.model = model
        self.storage = storage
        self.cache = cache
        self.attention_backend = attention_backend
        self.mla_backend = mla_backend
        self.model_id = model_id
        self.bos_token_id = bos_token_id
        self.stats = PICStats()
        self.cache_lock = cache_lock or CacheLock()

    def segment_key(self, backend: PICBackend, token_ids, context_ids=()) -> str:
        """The store key of a segment prefilled behind ``context_ids`` (``segment_context``): a backend with
        ``context="prefix"`` keys its entries by that prefix too, so K/V made behind one prefix never serves
        a request behind another."""
        cache_format = backend.cache_format
        if backend.context == "prefix":
            digest = hashlib.sha256(",".join(map(str, context_ids)).encode()).hexdigest()[:32]
            cache_format = f"{cache_format}+prefix:{digest}"
        return segment_key(self.model_id, cache_format, list(token_ids))

    def segment_context(self, backend: PICBackend, token_ids, pic_segments) -> tuple[int, ...]:
        """What a request's segments are prefilled behind for ``backend``: its tokens before the first PIC
        segment with ``context="prefix"``; otherwise the model's BOS, if it has one, or nothing."""
        if backend.context == "prefix":
            return tuple(int(t) for t in token_ids[:pic_segments[0].start]) if pic_segments else ()
        return () if self.bos_token_id is None else (self.bos_token_id,)

    @torch.inference_mode()
    def run(self, entry: ScheduledSequence) -> torch.Tensor:
        """Prefill ``entry``'s whole prompt after its prefix; returns the last token's hidden state [1, Hd]."""
        prepared = self._prepare(entry)
        with self.cache_lock.released():  # writes only the request's pages; the reused K/V was copied in
            [result] = entry.seq.pic_backend.combine_many([prepared.run])
        self.stats.combine_forwards += 1
        return self._finish(entry, prepared, result)

    @torch.inference_mode()
    def run_many(self, entries: Sequence[ScheduledSequence]) -> dict[str, torch.Tensor | Exception]:
        """``run`` of each entry, by sequence id: its hidden state, or the exception that stopped it.

        Requests with equal backends share one batched combine forward (``PICBackend.combine_many``). A failure
        is pinned on the requests that cause it: when a batched forward raises, each of its requests is prepared
        and combined again alone (its reused K/V placed anew, since the failed forward may have overwritten some).
        """
        outcomes: dict[str, torch.Tensor | Exception] = {}
        groups: dict[PICBackend, list[tuple[ScheduledSequence, _Prepared]]] = {}
        for entry in entries:
            try:
                groups.setdefault(entry.seq.pic_backend, []).append((entry, self._prepare(entry)))
            except Exception as exc:  # one request's lookup or placement
                outcomes[entry.seq_id] = exc
        for backend, group in groups.items():
            try:
                with self.cache_lock.released():
                    results = backend.combine_many([prepared.run for _, prepared in group])
            except Exception as exc:
                if len(group) == 1:
                    outcomes[group[0][0].seq_id] = exc
                    continue
                logger.warning("combine of %d requests failed (%r); running each alone to find the cause",
                               len(group), exc)
                for entry, _ in group:
                    outcomes[entry.seq_id] = self._run_alone(entry)
                continue
            self.stats.combine_forwards += 1
            for (entry, prepared), result in zip(group, results):
                try:
                    outcomes[entry.seq_id] = self._finish(entry, prepared, result)
                except Exception as exc:  # storing one request's states
                    outcomes[entry.seq_id] = exc
        return outcomes

    def _run_alone(self, entry: ScheduledSequence) -> torch.Tensor | Exception:
        try:
            return self.run(entry)
        except Exception as exc:
            return exc

    def _prepare(self, entry: ScheduledSequence) -> _Prepared:
        """Look ``entry``'s segments up (prefilling cold ones), place the reused K/V in its pages, plan the combine."""
        seq, backend = entry.seq, entry.seq.pic_backend
        segmented, prefix_len, num_tokens = seq.segmented, entry.num_computed_tokens, seq.num_prompt_tokens
        pic_segments = segmented.pic_segments
        cached: dict[int, CachedSegment] = {}
        locked: list[PICEntry] = []
        try:
            needed = {index: segmented.segment_ids(segment) for index, segment in enumerate(pic_segments)
                      # not inside the exact prefix, nor only the last token (always computed)
                      if max(segment.start, prefix_len) < min(segment.end, num_tokens - 1)}
            context = self.segment_context(backend, seq.token_ids, pic_segments)
            entries, fresh = self._lookup_or_prefill(backend, list(needed.values()), context)
            hits = set()  # segments whose KV existed before this request
            for index, found, made_now in zip(needed, entries, fresh):
                if found is not None:
                    locked.append(found)
                    cached[index] = CachedSegment(found.pages, found.num_tokens, found.state)
                    if not made_now:
                        hits.add(index)
            spans = [(s.start, s.length) for s in pic_segments]
            layout = CombineLayout.plan(num_tokens, prefix_len, spans, [i in cached for i in range(len(pic_segments))])
            device = self.storage.layer_caches[0][0].device
            run = CombineRun(self.model, torch.tensor(seq.token_ids[:num_tokens], device=device), layout,
                             torch.tensor(entry.block_table, dtype=torch.int64, device=device),
                             self.storage.page_size, self.storage.layer_caches, self.attention_backend,
                             self.mla_backend, cached)
            place_reused_kv(run)
        finally:
            for found in locked:
                self.cache.pic.unlock(found)
        hit_layout = CombineLayout.plan(num_tokens, prefix_len, spans, [i in hits for i in range(len(pic_segments))])
        return _Prepared(run, hit_layout.num_reused)

    def _finish(self, entry: ScheduledSequence, prepared: _Prepared, result: CombineResult) -> torch.Tensor:
        """Store a hybrid's linear states, record the request's PIC counts; the last token's hidden state."""
        seq, layout = entry.seq, prepared.run.layout
        if result.linear_states is not None:
            self._store_linear_states(entry.state_slot, result.linear_states)
        if seq.num_preemptions == 0:  # a resumed request reports its first combine's counts, as for its prefix
            seq.num_pic_cached_tokens = layout.num_reused
            seq.num_pic_hit_tokens = prepared.num_hit_tokens
            seq.num_recomputed_tokens = result.num_recomputed
        if result.num_recomputed < layout.num_reused:  # cached K/V kept somewhere: approximate from there on
            seq.num_exact_kv_tokens = min(seq.num_exact_kv_tokens, layout.reused[0].start)
        self.stats.combines += 1
        return result.hidden

    def lookup_or_prefill(self, backend: PICBackend, token_ids, context_ids=None) -> PICEntry | None:
        """The segment's store entry, locked: found (maybe promoted from a lower tier) or prefilled now behind
        ``context_ids`` (None: the backend's context for a segment that starts the prompt). None when it is cold
        and the pool has no room for it."""
        return self.lookup_or_prefill_many(backend, [token_ids], context_ids)[0][0]

    def lookup_or_prefill_many(self, backend: PICBackend, segments: list, context_ids=None
                               ) -> tuple[list[PICEntry | None], list[bool]]:
        """``lookup_or_prefill`` for several segments behind the same context, and per segment whether this call
        prefilled it (found on the device or promoted from a lower tier: not); the cold ones are prefilled
        together (one forward when the backend batches them). A segment repeated in ``segments`` is prefilled
        once."""
        return self._lookup_or_prefill(backend, segments, self._context(backend, context_ids))

    def _context(self, backend: PICBackend, context_ids) -> tuple[int, ...]:
        """``context_ids`` as a tuple; None: the backend's context for a segment that starts the prompt."""
        return self.segment_context(backend, (), ()) if context_ids is None else tuple(context_ids)

    def _lookup_or_prefill(self, backend: PICBackend, segments: list,
                           context_ids: tuple[int, ...]) -> tuple[list[PICEntry | None], list[bool]]:
        """``lookup_or_prefill_many``, plus per segment whether its entry was prefilled by this call."""
        keys = [self.segment_key(backend, ids, context_ids) for ids in segments]
        entries: list[PICEntry | None] = []
        cold: dict[str, list] = {}
        for key, ids in zip(keys, segments):
            found = self.cache.lookup_segment(key, len(ids))
            entries.append(found)
            if found is not None:
                self.stats.segment_hits += 1
            else:
                cold.setdefault(key, list(ids))
        created = self.prefill_segments(backend, cold, context_ids) if cold else {}
        handed_out: set[str] = set()
        for i, key in enumerate(keys):
            if entries[i] is None and created.get(key) is not None:
                entries[i] = created[key]
                if key in handed_out:  # a repeated segment: one lock per returned handle
                    self.cache.pic.lock(entries[i])
                handed_out.add(key)
        self.stats.segment_misses += sum(1 for e in created.values() if e is not None)
        self.stats.segment_tokens_prefilled += sum(len(cold[k]) for k, e in created.items() if e is not None)
        self.stats.segment_skipped += sum(1 for e in created.values() if e is None)
        return entries, [key in created for key in keys]

    @torch.inference_mode()  # callers outside an engine step (a scatter, a cluster peer's own-segment prefill)
    def prefill_segments(self, backend: PICBackend, cold: dict[str, list],
                         context_ids=None) -> dict[str, PICEntry | None]:
        """Scatter prefill: compute each segment behind ``context_ids`` (None: ``_context``; their K/V is dropped)
        into new pages and store it under ``key`` (``segment_key`` of the same context); entries come back locked.
        A segment the pool has no room for maps to None."""
        page_size = self.storage.page_size
        device = self.storage.layer_caches[0][0].device
        pool = self.cache.pool
        context_ids = self._context(backend, context_ids)
        planned, held = [], []
        for key, ids in cold.items():
            num_pages = -(-len(ids) // page_size)
            scratch = -(-len(context_ids) // page_size)
            try:
                pages = pool.allocate(num_pages + scratch)
            except OutOfPagesError:
                continue
            held.append(pages)
            scratch_slots = tuple(pages[num_pages + i // page_size] * page_size + i % page_size
                                  for i in range(len(context_ids)))
            planned.append((key, ids, pages[:num_pages], SegmentPrefill(
                torch.tensor(ids, dtype=torch.int64, device=device), tuple(pages[:num_pages]), page_size,
                self.storage.layer_caches, self.attention_backend, self.mla_backend, tuple(context_ids),
                scratch_slots)))
        created: dict[str, PICEntry | None] = dict.fromkeys(cold)
        try:
            with self.cache_lock.released():  # writes only the pages held above
                states = backend.prefill_segments(self.model, [p[3] for p in planned]) if planned else []
            for (key, ids, pages, _), state in zip(planned, states):
                created[key] = self.cache.insert_segment(key, len(ids), pages, state)
        finally:
            for pages in held:
                pool.release(pages)  # the store holds its own reference on each segment's pages
        return created

    def _store_linear_states(self, slot: int, states) -> None:
        for (conv, recurrent), state in zip(self.storage.linear_states, states):
            conv[slot] = state.conv.to(conv.dtype)
            recurrent[slot] = state.recurrent.to(recurrent.dtype)

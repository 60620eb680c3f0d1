"""``KVPort``: the engine's KV cache, as another component (a cluster peer) reaches it.

Pin and unpin what a remote reader copies, read what a held request or a pin holds, take and give back pages, store
what was read from another engine (segments, prefixes), prefill PIC segments into the store, ask what the prefix
cache holds and where a segment is, evict down to the tiers below and wait for their writes, and drain what the
cache reports. Each operation is async and never races the engine loop: one that
touches only the KV cache (pages, pins, storing what was read, prefix queries) runs under the engine's cache lock
(``AsyncLLMEngine.call_cache``), so it gets in while a step's forward computes; the others (prefilling segments,
cache events, a held request's pages) run on the engine's own thread between two steps (``AsyncLLMEngine.call``).
A pin served mid-step is what lets a remote read cost less than recomputing a short segment.

Only constants set in ``LLMEngine.__init__`` are read directly, from any thread: the page geometry, the tiers'
layout, the KV tensors NIXL registers, a backend's PIC format, and segment keys and contexts (pure functions of the
model, the backend and the token ids).
Requests themselves go through ``request_port.RequestPort``; the data both ports hand out is in ``port_types``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Mapping

import torch

from nebula_engine.engine.async_engine import AsyncLLMEngine
from nebula_engine.engine.kv_gate import KVGate
from nebula_engine.engine.llm_engine import LLMEngine
from nebula_engine.engine.port_types import CacheDrain, KVGeometry, PICFormat, PrefixPin, SegmentPin, TierLayout
from nebula_engine.kvcache.events import CacheKind, Tier
from nebula_engine.kvcache.pool import OutOfPagesError


class KVPort:
    """The KV cache operations of one engine; see the module docstring for the thread rule.

    ``backend_spec`` arguments are what ``LLMEngine.resolve_request_backend`` takes for a request."""

    def __init__(self, engine: AsyncLLMEngine):
        self._async = engine
        self._engine = engine.engine  # read here only for constants; state goes through _call
        storage = self._engine.model_runner.kv_storage
        self.page_size: int = storage.page_size
        self.kv_geometry = KVGeometry(storage.page_size, storage.num_pages, sum(
            t[0].numel() * t.element_size() for tensors in storage.layer_caches for t in tensors) // storage.page_size)
        self.caches_prefixes: bool = self._engine.scheduler.prefix_cache is not None
        # the name of the PIC backend requests get by default (None: PIC off), which the planner costs combines by
        self.pic_backend_name: str | None = (self._engine.pic_backend.name
                                             if self._engine.pic_backend is not None else None)
        # a hybrid model's combine starts at position 0 (``Scheduler._match_prefix``): a cached lead does not help it
        self.combines_start_after_prefix: bool = (self.caches_prefixes
                                                  and self._engine.scheduler.kv_cache.state_slots is None)
        store = self._engine.cache_store
        tiers = store.tiers if store is not None else None
        self.tier_layout = TierLayout(0, 0, None, False) if tiers is None else TierLayout(
            tiers.host.capacity_tokens if tiers.host else 0, tiers.disk.capacity_tokens if tiers.disk else 0,
            tiers.disk.root if tiers.disk else None, tiers.config.demote_on_evict)
        # ``prefill_segment`` calls not yet taken by the engine thread (appended on the event loop, taken there);
        # while any wait, an engine call that will take them is on its way
        self._segments_lock = threading.Lock()
        self._segments_asked: list[tuple[Any, list[int], asyncio.Future]] = []

    def transfer_tensors(self) -> list[torch.Tensor]:
        """Every attention layer's KV tensors (not the linear-attention state slots): what NIXL registers."""
        return [t for layer in self._engine.model_runner.kv_storage.layer_caches for t in layer]

    def segment_key(self, backend_spec, token_ids, context_ids=()) -> str:
        """``LLMEngine.segment_key``: the PIC store key the router and workers name a segment by."""
        return self._engine.segment_key(backend_spec, token_ids, context_ids)

    def segment_context(self, backend_spec, token_ids, pic_segments) -> tuple[int, ...]:
        """``LLMEngine.segment_context``: what a request's segments are prefilled behind."""
        return self._engine.segment_context(backend_spec, token_ids, pic_segments)

    def pic_format(self, backend_spec) -> PICFormat | None:
        """How this engine stores the segments of a request with that backend; None when it runs without PIC."""
        backend = self._engine.resolve_request_backend(backend_spec)
        executor = self._engine.model_runner.pic_executor
        if backend is None or executor is None:
            return None
        return PICFormat(executor.model_id, backend.spec, backend.cache_format, backend.context == "prefix")

    async def _call(self, fn):
        """``fn(engine)`` on the engine thread, between two steps."""
        return await self._async.call(fn)

    async def _call_cache(self, fn):
        """``fn(engine)``, touching only the cache store, under the cache lock: it need not wait for a step to end."""
        return await self._async.call_cache(fn)

    # ---- a held request's KV (prefill -> decode hand-off) ----
    async def held_pages(self, request_id: str) -> list[int]:
        """Pages of a finished held request (``RequestPort.generate_held``): its prompt K/V for the decode peer."""
        return await self._call(lambda e: e.held_block_table(request_id))

    async def held_state(self, request_id: str) -> dict[str, list[torch.Tensor]]:
        """The linear-attention state after a held request's prompt (``LLMEngine.held_linear_state``, on the CPU):
        what the decode peer continues from; empty for models without linear-attention layers."""
        return await self._call(lambda e: e.held_linear_state(request_id))

    # ---- pages ----
    async def allocate_pages(self, num_pages: int, unless_cached: str | None = None) -> list[int] | None:
        """``num_pages`` free pages; None when the pool is full, or when the PIC store already holds the segment
        ``unless_cached`` (then nothing needs copying in)."""
        def allocate(engine: LLMEngine) -> list[int] | None:
            if unless_cached is not None and engine.cache_store.pic.lookup(unless_cached) is not None:
                return None
            try:
                return engine.cache_store.pool.allocate(num_pages)
            except OutOfPagesError:
                return None

        return await self._call_cache(allocate)

    async def release_pages(self, pages: list[int]) -> None:
        await self._call_cache(lambda e: e.cache_store.pool.release(pages))

    # ---- PIC segments ----
    async def pin_segment(self, key: str, num_tokens: int) -> SegmentPin | None:
        """The segment ``key`` locked on the device (promoted from a lower tier if needed); None on a miss."""
        def pin(engine: LLMEngine) -> SegmentPin | None:
            entry = engine.cache_store.lookup_segment(key, num_tokens)  # locked
            return None if entry is None else SegmentPin(tuple(entry.pages), dict(entry.state), entry)

        return await self._call_cache(pin)

    async def unpin_segment(self, pin: SegmentPin) -> None:
        await self._call_cache(lambda e: e.cache_store.pic.unlock(pin.entry))

    async def import_segment(self, key: str, num_tokens: int, pages: list[int], state: Mapping[str, Any]) -> None:
        """Store a segment whose K/V was written into ``pages`` (from ``allocate_pages``); the pages pass to the
        store (an entry already under ``key`` wins, and the pages are freed)."""
        def insert(engine: LLMEngine) -> None:
            entry = engine.cache_store.insert_segment(key, num_tokens, pages, state)
            engine.cache_store.pic.unlock(entry)
            engine.cache_store.pool.release(pages)  # the store holds its own reference

        await self._call_cache(insert)

    async def prefill_segment(self, backend_spec, token_ids: list[int]) -> None:
        """Make sure the segment is in the PIC store: found there, or prefilled alone now (when the pool has
        room). Segments asked for while an earlier call still waits for the engine thread are prefilled with it,
        in one forward per backend (a helper gets a request's scatters back to back): 3 segments of 280 tokens
        took 113 ms together against 130 ms one after another on the bench model (one thread, median of 12)."""
        done = asyncio.get_running_loop().create_future()
        with self._segments_lock:
            start_batch = not self._segments_asked
            self._segments_asked.append((backend_spec, list(token_ids), done))
        if start_batch:
            asyncio.ensure_future(self._prefill_segments_asked())
        await done

    def _take_segments_asked(self) -> list[tuple[Any, list[int], asyncio.Future]]:
        with self._segments_lock:
            taken, self._segments_asked = self._segments_asked, []
        return taken

    async def _prefill_segments_asked(self) -> None:
        """One engine call for every ``prefill_segment`` asked until the engine thread runs it; each caller's
        future gets its segment's outcome: done, or the error of its backend's forward (or of the call)."""
        taken: list[tuple[Any, list[int], asyncio.Future]] = []
        errors: dict[Any, Exception] = {}  # backend spec -> why its segments failed

        def prefill(engine: LLMEngine) -> None:
            taken.extend(self._take_segments_asked())
            by_backend: dict[Any, list[list[int]]] = {}
            for spec, ids, _ in taken:
                by_backend.setdefault(spec, []).append(ids)
            for spec, segments in by_backend.items():
                try:
                    backend = engine.resolve_request_backend(spec)
                    entries, _ = engine.model_runner.pic_executor.lookup_or_prefill_many(backend, segments)
                except Exception as exc:  # one request's backend must not fail another's segments
                    errors[spec] = exc
                    continue
                for entry in entries:
                    if entry is not None:
                        engine.cache_store.pic.unlock(entry)

        try:
            await self._call(prefill)
        except Exception as exc:  # the engine is shut down: every caller gets it
            taken = taken or self._take_segments_asked()  # (never run: nothing was taken)
            errors = {spec: exc for spec, _, _ in taken}
        for spec, _, done in taken:
            if done.done():  # (its caller was cancelled)
                continue
            if spec in errors:
                done.set_exception(errors[spec])
            else:
                done.set_result(None)

    async def prefill_missing_segments(self, backend_spec, segments: list[list[int]],
                                       then_open: tuple[KVGate, str] | None = None,
                                       context_ids: tuple[int, ...] | None = None) -> list[bool]:
        """Prefill together the segments the PIC store lacks; per segment, True when this call prefilled it (one
        found on the device or promoted from a lower tier existed before, or one the pool had no room for: False).
        All False for a request without PIC. ``then_open``: (gate, part) opened on the engine's thread as soon as
        the prefill ends, so a combine waiting for these segments can be scheduled in the very next step.
        ``context_ids``: what they are prefilled behind (``segment_context``; None: the backend's context for a
        segment that starts the prompt)."""
        def prefill(engine: LLMEngine) -> list[bool]:
            try:
                backend = engine.resolve_request_backend(backend_spec)
                if backend is None:
                    return [False] * len(segments)
                entries, created = engine.model_runner.pic_executor.lookup_or_prefill_many(backend, segments,
                                                                                           context_ids)
                for entry in entries:
                    if entry is not None:
                        engine.cache_store.pic.unlock(entry)
                return [entry is not None and made for entry, made in zip(entries, created)]
            finally:
                if then_open is not None:
                    then_open[0].open(then_open[1])

        return await self._call(prefill)

    # ---- cached prefixes ----
    async def cached_prefix_pages(self, token_ids: list[int]) -> int:
        """How many leading pages of ``token_ids`` the prefix cache holds."""
        return await self._call_cache(lambda e: len(e.cache_store.radix.match_prefix(token_ids).pages))

    async def pin_prefix(self, token_ids: list[int]) -> PrefixPin | None:
        """The cached leading pages of ``token_ids``, locked; None when not even the first page is cached."""
        def pin(engine: LLMEngine) -> PrefixPin | None:
            radix = engine.cache_store.radix
            match = radix.match_prefix(token_ids)
            if not match.pages:
                return None
            radix.inc_lock_ref(match.last_node)
            return PrefixPin(tuple(match.pages), match.last_node)

        return await self._call_cache(pin)

    async def unpin_prefix(self, pin: PrefixPin) -> None:
        await self._call_cache(lambda e: e.cache_store.radix.dec_lock_ref(pin.node))

    async def import_prefix(self, token_ids: list[int], pages: list[int], after_pages: int = 0) -> bool:
        """Cache ``pages`` (from ``allocate_pages``, K/V written) as the pages of ``token_ids`` that follow its first
        ``after_pages`` pages, which the prefix cache holds, one page per ``page_size`` tokens; the pages pass to the
        prefix cache. False (the pages released) when those leading pages are no longer all cached."""
        def insert(engine: LLMEngine) -> bool:
            store, start = engine.cache_store, after_pages * self.page_size
            node = store.radix.root
            if after_pages:
                match = store.radix.match_prefix(token_ids[:start])
                if len(match.pages) < after_pages:  # evicted since the caller looked
                    store.pool.release(pages)
                    return False
                node = match.last_node
            last = store.insert_prefix(node, token_ids[start:start + len(pages) * self.page_size], pages)  # locked
            store.radix.dec_lock_ref(last)
            store.pool.release(pages)  # the tree holds its own reference to the pages it kept
            return True

        return await self._call_cache(insert)

    async def cached_prefix_hashes(self, token_ids: list[int], page_counts: list[int]) -> list[str]:
        """For each count in ``page_counts`` (ascending), the block hash of the last of that many leading pages
        of ``token_ids``, while they are all cached; stops at the first count that is not."""
        def collect(engine: LLMEngine) -> list[str]:
            radix, hashes = engine.cache_store.radix, []
            for pages in page_counts:
                match = radix.match_prefix(list(token_ids[:pages * self.page_size]))
                if len(match.pages) < pages:
                    break
                hashes.append(match.last_node.block_hash)
            return hashes

        return await self._call_cache(collect)

    # ---- cache state ----
    async def drain_cache_events(self, snapshot: bool = False) -> CacheDrain:
        """The cache's events since the last drain; with ``snapshot``, in the same step, every PIC entry with the
        tier it is on. Empty for an engine without a cache store."""
        def drain(engine: LLMEngine) -> CacheDrain:
            store = engine.cache_store
            if store is None:
                return CacheDrain([])
            events = store.drain_events()
            if not snapshot:
                return CacheDrain(events)
            lower = store.tiers.entries() if store.tiers else ()
            return CacheDrain(events, [(e.key, e.num_tokens, Tier.DEVICE) for e in store.pic.entries()] +
                              [(key, tokens, tier) for kind, key, tier, tokens in lower if kind is CacheKind.PIC])

        return await self._call(drain)

    async def segment_tier(self, key: str) -> Tier | None:
        """Where the PIC store holds the segment ``key`` now (the device, or a tier below it); None: nowhere."""
        def find(engine: LLMEngine) -> Tier | None:
            store = engine.cache_store
            if store is None:
                return None
            if key in store.pic:
                return Tier.DEVICE
            return store.tiers.tier_of(CacheKind.PIC, key) if store.tiers else None

        return await self._call_cache(find)

    async def evict_unlocked(self) -> int:
        """Evict every entry of the device cache that no request or reader holds, as pool pressure would
        (``CacheStore.evict_all``): down to the tiers below when they take it, else dropped. How many left."""
        return await self._call_cache(lambda e: e.cache_store.evict_all() if e.cache_store else 0)

    async def flush_tiers(self, keys: list[str] = ()) -> list[str]:
        """Wait for the lower tiers' background writes; returns those of the PIC segments ``keys`` that the disk
        tier took but failed to write (what was written stays)."""
        def flush(engine: LLMEngine) -> list[str]:
            store = engine.cache_store
            if store is None:
                return []
            store.flush()
            disk, kind = store.tiers.disk if store.tiers else None, CacheKind.PIC.value
            if disk is None:
                return []
            return [key for key in keys if (kind, key) in disk and not disk.is_written(kind, key)]

        return await self._call(flush)

    async def close_tiers(self) -> None:
        """Finish the lower tiers' background I/O and stop its thread; the disk tier stays valid for a restart.
        The last call before ``RequestPort.shutdown`` of an engine that has a disk tier."""
        await self._call(lambda e: e.cache_store and e.cache_store.close())

    async def set_pc_share(self, pc_share: float) -> None:
        """Retarget the prefix cache's share of the device cache (no-op without a cache store)."""
        await self._call(lambda e: e.cache_store and e.cache_store.set_pc_share(pc_share))

    async def pic_stats(self) -> dict[str, int]:
        """The PIC executor's counters (hits, misses, ...); empty without PIC."""
        return await self._call(lambda e: dict(vars(e.model_runner.pic_executor.stats))
                                if e.model_runner.pic_executor else {})

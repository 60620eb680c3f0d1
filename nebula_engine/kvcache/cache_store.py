"""One worker's cached KV: the PC radix tree and the PIC segment store over one ``PagePool``.

Both types draw pages from the same pool (the shared budget, DESIGN §4), which the store owns: it builds the
pool with ``evict`` as its reclaimer, so when the pool is short, ``evict`` frees unlocked pages, the eviction
policy choosing the type each time and each store its LRU victim. Every store and evict becomes an event in
``events``; ``snapshot()`` is the index those events describe.

Handles returned by ``insert_prefix`` / ``insert_segment`` / ``promote_prefix`` / ``lookup_segment``
come back locked: an unlocked handle's pages may be evicted by the next allocation.

With lower tiers (``TierConfig``) an evicted entry is demoted instead of dropped, its page contents
read through ``page_io``; a prefix or segment found on a lower tier is promoted into fresh pages.

States live in pool pages too (``page_blob``, through ``blob_io`` when the store is given one): a prefix node's
linear-attention state (hybrid models) and the tensors of a PIC segment's backend state (HYPIC's transition maps).
They count in the stores' sizes, leave the device with their entry, and are charged to the tiers by their pages.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import logging

from nebula_engine.kvcache.events import CacheIndex, CacheKind, EventLog, IndexEntry, Tier
from nebula_engine.kvcache.eviction import CacheState, make_eviction_policy
from nebula_engine.kvcache.page_blob import PageBlobIO, TensorLayout, pack_tensors, unpack_tensors
from nebula_engine.kvcache.pic_store import PICEntry, PICStore
from nebula_engine.kvcache.page_io import PageIO
from nebula_engine.kvcache.pool import OutOfPagesError, PagePool
from nebula_engine.kvcache.radix_cache import EXACT, RadixCache, TreeNode, block_hash
from nebula_engine.kvcache.tiers import TierChain, TierConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheStoreConfig:
    worker_id: int = 0
    model_id: str = ""  # part of every key, so two models never share an entry
    eviction_policy: str = "soft-share"  # soft-share | unified-lru | fixed-partition
    pc_share: float = 0.5  # p: target PC share (soft-share) or PC partition (fixed-partition)


class CacheStore:
    def __init__(self, num_pages: int, page_size: int, config: CacheStoreConfig = CacheStoreConfig(),
                 tiers: TierConfig | None = None, page_io: PageIO | None = None, blob_io: PageBlobIO | None = None):
        """A pool of ``num_pages`` pages, built here with ``evict`` as its reclaimer. ``page_io`` copies pages
        to and from the lower ``tiers`` (required with tiers); ``blob_io`` keeps PIC states in pool pages (None:
        they stay tensors, outside the pool's budget)."""
        if tiers is not None and page_io is None:
            raise ValueError("lower cache tiers need a page_io to copy pages off and back onto the device")
        self.pool = PagePool(num_pages, reclaimer=self.evict)
        self.page_size = page_size
        self.config = config
        self.page_io = page_io
        self.blob_io = blob_io
        self.num_states_outside_pages = 0  # PIC states kept as tensors: the pool had no room for their pages
        self.events = EventLog(config.worker_id)
        self.tiers = TierChain(tiers, self.events) if tiers is not None else None
        demote_node, demote_segment, discard_lower = (
            (self._demote_node, self._demote_segment, self.tiers.discard) if self.tiers else (None, None, None))
        clock = itertools.count(1)  # one clock for both types, so unified-lru can compare them
        self.radix = RadixCache(self.pool, page_size, self.events, clock, config.model_id, demote_node, discard_lower)
        self.pic = PICStore(self.pool, page_size, self.events, clock, demote_segment, discard_lower)
        self.policy = make_eviction_policy(config.eviction_policy, config.pc_share)

    def _demote_node(self, node: TreeNode) -> bool:
        payload = {"pages": self.page_io.read_pages([node.page])}
        if node.state_pages:
            payload["state_pages"] = self.page_io.read_pages(list(node.state_pages))
        return self.tiers.demote(CacheKind.PC, node.block_hash, self.page_size, payload,
                                 node.num_pages * self.page_size)

    def _demote_segment(self, entry: PICEntry) -> bool:
        payload = {"pages": self.page_io.read_pages(list(entry.pages)), "state": dict(entry.state),
                   "num_tokens": entry.num_tokens}
        return self.tiers.demote(CacheKind.PIC, entry.key, entry.num_tokens, payload, entry.size)

    def promote_prefix(self, node: TreeNode, token_ids: list[int]) -> tuple[TreeNode, list[int]]:
        """Continue locked ``node``'s prefix with pages of ``token_ids`` held on lower tiers.

        Returns (deepest node, now locked in ``node``'s place; the promoted pages in order).
        Stops at the first page that is on no tier, fails verification, or finds no free page.
        Pages of ``node``'s provenance only: an exact prefix is continued by exact pages.
        """
        pages: list[int] = []
        provenance = node.provenance
        for start in range(0, len(token_ids) - self.page_size + 1, self.page_size) if self.tiers else ():
            tokens = token_ids[start:start + self.page_size]
            key = block_hash(node.block_hash, tuple(tokens), provenance)
            promoted = self._promote_into_pages(CacheKind.PC, key, 1)
            if promoted is None:
                break
            new_pages, payload = promoted
            child = self.radix.insert(node, tokens, new_pages, promoted=True, provenance=provenance)
            self.pool.release(new_pages)  # the tree holds its own reference now
            if "state_pages" in payload:
                self._promote_node_state(child, payload["state_pages"])
            self.radix.inc_lock_ref(child)
            self.radix.dec_lock_ref(node)
            node = child
            pages += new_pages
        return node, pages

    def _promote_node_state(self, node: TreeNode, data: list) -> None:
        """Write a promoted node's linear-attention state back into fresh pages; without room the node comes
        back without it (its K/V stays usable below a deeper state)."""
        try:
            pages = self.pool.allocate(data[0].shape[0])
        except OutOfPagesError:
            return
        self.page_io.write_pages(pages, data)
        self.radix.attach_state(node, pages)
        self.pool.release(pages)

    def save_node_state(self, node: TreeNode, write: Callable[[list[int]], None], num_pages: int) -> bool:
        """Give ``node`` a linear-attention state: ``num_pages`` fresh pages filled by ``write``. False (nothing
        changed) when the node has one already or the pool has no room even after eviction."""
        if node.is_root or node.state_pages:
            return False
        self.radix.inc_lock_ref(node)  # the allocation below may evict: never this node
        try:
            pages = self.pool.allocate(num_pages)
        except OutOfPagesError:
            return False
        finally:
            self.radix.dec_lock_ref(node)
        write(pages)
        self.radix.attach_state(node, pages)
        self.pool.release(pages)
        self._enforce_quota(CacheKind.PC)
        return True

    def loading(self, node: TreeNode, token_ids: list[int]) -> bool:
        """Whether pages continuing ``node``'s prefix with ``token_ids`` are still being read from disk.

        Starts the reads it finds missing, so a later ``promote_prefix`` does not wait on the disk.
        """
        pending, key = False, node.block_hash
        for start in range(0, len(token_ids) - self.page_size + 1, self.page_size) if self.tiers else ():
            key = block_hash(key, tuple(token_ids[start:start + self.page_size]), node.provenance)
            tier = self.tiers.tier_of(CacheKind.PC, key)
            if tier is None:
                break
            load = self.tiers.prefetch(CacheKind.PC, key) if tier is Tier.DISK else None
            pending = pending or (load is not None and not load.done())
        return pending

    def _promote_into_pages(self, kind: CacheKind, key: str, num_pages: int) -> tuple[list[int], dict] | None:
        """(fresh pages holding ``key``'s contents, its payload), or None on a miss; the caller owns the pages."""
        if self.tiers.tier_of(kind, key) is None:
            return None
        try:
            pages = self.pool.allocate(num_pages)  # may demote others, even ``key`` further down
        except OutOfPagesError:
            return None
        payload = self.tiers.promote(kind, key)
        if payload is None:
            self.pool.release(pages)
            return None
        self.page_io.write_pages(pages, payload["pages"])
        return pages, payload

    def lookup_segment(self, key: str, num_tokens: int) -> PICEntry | None:
        """The segment on the device (promoted from a lower tier if needed), locked; None on a miss.

        ``num_tokens`` is the segment's length: it sizes the pages a promotion needs.
        """
        entry = self.pic.lookup(key)
        if entry is None and self.tiers is not None:
            promoted = self._promote_into_pages(CacheKind.PIC, key, -(-num_tokens // self.page_size))
            if promoted is not None:
                pages, payload = promoted
                entry = self._insert_segment(key, num_tokens, pages, payload["state"], promoted=True)
                self.pool.release(pages)
        if entry is not None:
            self.pic.lock(entry)
        return entry

    def _insert_segment(self, key: str, num_tokens: int, pages: list[int], state: Mapping[str, Any] | None,
                        promoted: bool = False) -> PICEntry:
        """``pic.insert``, the tensors of ``state`` moved into pool pages of their own when the store has a
        ``blob_io``. Without room for those pages the state stays as tensors (counted in
        ``num_states_outside_pages``)."""
        skeleton, tensors = pack_tensors(dict(state or {}))
        if self.blob_io is None or not tensors or key in self.pic:
            return self.pic.insert(key, num_tokens, pages, state, promoted)
        layouts = tuple(TensorLayout.of(t) for t in tensors)
        try:
            state_pages = self.pool.allocate(self.blob_io.pages_for(sum(layout.nbytes for layout in layouts)))
        except OutOfPagesError:
            self.num_states_outside_pages += 1
            logger.warning("PIC segment %s: no pool room for its state's pages; kept outside the pool budget", key)
            return self.pic.insert(key, num_tokens, pages, state, promoted)
        self.blob_io.write(state_pages, tensors)
        entry = self.pic.insert(key, num_tokens, pages, skeleton, promoted, state_pages, layouts,
                                self._read_segment_state)
        self.pool.release(state_pages)
        return entry

    def _read_segment_state(self, entry: PICEntry) -> Mapping[str, Any]:
        return unpack_tensors(entry.stored_state, self.blob_io.read(list(entry.state_pages), list(entry.state_layouts)))

    def set_pc_share(self, pc_share: float) -> None:
        """Retarget the PC share; nothing is evicted now, later evictions follow the new target."""
        self.policy.pc_share = pc_share

    @property
    def num_evictable_pages(self) -> int:
        return self.radix.evictable_size // self.page_size + self.pic.num_evictable_pages

    def state(self) -> CacheState:
        return CacheState(self.radix.total_size, self.pic.total_size, self.pool.num_pages * self.page_size,
                          self.radix.oldest_evictable(), self.pic.oldest_evictable())

    def insert_prefix(self, node: TreeNode, token_ids: list[int], pages: list[int],
                      provenance: str = EXACT) -> TreeNode:
        """Cache full pages of ``provenance`` continuing ``node``'s prefix; returns the last page's node, locked."""
        last = self.radix.insert(node, token_ids, pages, provenance=provenance)
        self.radix.inc_lock_ref(last)
        self._enforce_quota(CacheKind.PC)
        return last

    def insert_segment(self, key: str, num_tokens: int, pages: list[int],
                       state: Mapping[str, Any] | None = None) -> PICEntry:
        """Cache a PIC segment (an existing key wins); returns its entry, locked."""
        entry = self._insert_segment(key, num_tokens, pages, state)
        self.pic.lock(entry)
        self._enforce_quota(CacheKind.PIC)
        return entry

    def _enforce_quota(self, kind: CacheKind) -> None:
        while self.policy.over_quota(kind, self.state()) and self._evict_kind(kind):
            pass

    def evict(self, num_pages: int) -> int:
        """Evict until ``num_pages`` more pages are free or nothing is evictable; returns pages freed."""
        start = self.pool.num_free_pages
        while self.pool.num_free_pages - start < num_pages:
            kind = self.policy.victim_kind(self.state())
            if kind is None or not self._evict_kind(kind):
                break
        return self.pool.num_free_pages - start

    def evict_all(self) -> int:
        """Evict every unlocked entry now, PC then PIC, each as pool pressure would: moved to the tiers below
        when they take it, else dropped. Returns how many entries left the device.

        Offline prefill uses it to push each segment it computed straight down to the disk tier.
        """
        count = 0
        for store in (self.radix, self.pic):
            while store.evict_one() is not None:
                count += 1
        return count

    def _evict_kind(self, kind: CacheKind) -> bool:
        store = self.radix if kind is CacheKind.PC else self.pic
        return store.evict_one() is not None

    def promoted_tokens(self) -> dict[tuple[CacheKind, Tier], int]:
        """Tokens found on each lower tier and brought back to the device so far, per (kind, tier)."""
        return dict(self.tiers.promoted_tokens) if self.tiers is not None else {}

    def occupancy(self) -> dict[tuple[CacheKind, Tier], int]:
        """Tokens held per (kind, tier)."""
        return self.snapshot().occupancy()

    def snapshot(self) -> CacheIndex:
        """The full index now; equals the replay of every event emitted so far."""
        index = CacheIndex(self.config.worker_id, self.events.last_seq)
        for node in self.radix.nodes():
            index.entries[CacheKind.PC, node.block_hash] = IndexEntry(Tier.DEVICE, self.page_size)
        for entry in self.pic.entries():
            index.entries[CacheKind.PIC, entry.key] = IndexEntry(Tier.DEVICE, entry.num_tokens)
        for kind, key, tier, num_tokens in self.tiers.entries() if self.tiers else ():
            index.entries[kind, key] = IndexEntry(tier, num_tokens)
        return index

    def flush(self) -> None:
        """Wait for background tier I/O."""
        if self.tiers is not None:
            self.tiers.flush()

    def close(self) -> None:
        """Finish background tier I/O and stop its thread; the disk tier stays valid for a restart."""
        if self.tiers is not None:
            self.tiers.close()

    def drain_events(self):
        return self.events.drain_events()

    def check_integrity(self) -> None:
        self.radix.check_integrity()
        self.pic.check_integrity()

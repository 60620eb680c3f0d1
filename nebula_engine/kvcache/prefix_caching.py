"""Block tables with prefix caching: a ``KVCacheManager`` whose full pages outlive their sequence.

A sequence starts from the longest cached prefix of its tokens (``match_prefix``), caches each page
it fills (``cache_pages``) and keeps the deepest cached node of its prefix locked until it is freed,
so no page in its block table can be evicted under it. Unlocked cached pages count as free: the
pool evicts them (policy of ``CacheStore``) before an allocation fails.
"""

from __future__ import annotations

from nebula_engine.kvcache.cache_store import CacheStore, CacheStoreConfig
from nebula_engine.kvcache.pool import KVCacheError, KVCacheManager
from nebula_engine.kvcache.radix_cache import TreeNode
from nebula_engine.kvcache.tiers import TierConfig


class PrefixCachingKVCacheManager(KVCacheManager):
    def __init__(self, num_pages: int, page_size: int, num_state_slots: int = 0,
                 store_config: CacheStoreConfig = CacheStoreConfig(), tiers: TierConfig | None = None,
                 enable_prefix_matching: bool = True):
        super().__init__(num_pages, page_size, num_state_slots)
        # False: only the PIC store is used (models whose linear-attention state does not split at pages)
        self.enable_prefix_matching = enable_prefix_matching
        self.cache = CacheStore(self.pool, page_size, store_config, tiers)
        self.pool.reclaimer = self.cache.evict
        self._locked: dict[str, TreeNode] = {}  # seq -> deepest cached node of its prefix (locked)
        self._num_cached_pages: dict[str, int] = {}  # leading pages of its block table in the tree

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages + self.cache.num_evictable_pages

    def match_prefix(self, seq_id: str, token_ids: list[int]) -> int:
        """Start ``seq_id``'s block table with the cached prefix of ``token_ids``; returns its tokens.

        The last token is never a hit: it must be computed to sample the next one.
        """
        if seq_id in self.block_tables:
            raise KVCacheError(f"sequence {seq_id!r} already has a block table")
        usable = token_ids[: len(token_ids) - 1]
        match = self.cache.radix.match_prefix(usable)
        self.cache.radix.inc_lock_ref(match.last_node)
        last, promoted = self.cache.promote_prefix(match.last_node, usable[len(match.pages) * self.page_size:])
        pages = match.pages + promoted
        self.pool.share(pages)
        self.block_tables[seq_id] = pages
        self._locked[seq_id] = last
        self._num_cached_pages[seq_id] = len(pages)
        return len(pages) * self.page_size

    def loading(self, token_ids: list[int]) -> bool:
        """Whether part of the cached prefix of ``token_ids`` is still being read from disk."""
        usable = token_ids[: len(token_ids) - 1]
        match = self.cache.radix.match_prefix(usable)
        return self.cache.loading(match.last_node, usable[len(match.pages) * self.page_size:])

    def cache_pages(self, seq_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Insert the pages ``seq_id`` has filled since the last call into the prefix tree."""
        num_full = num_computed_tokens // self.page_size
        done = self._num_cached_pages.get(seq_id, 0)
        if num_full <= done:
            return
        node = self._locked.get(seq_id, self.cache.radix.root)
        tokens = token_ids[done * self.page_size: num_full * self.page_size]
        last = self.cache.insert_prefix(node, tokens, self.block_tables[seq_id][done:num_full])
        self.cache.radix.dec_lock_ref(node)
        self._locked[seq_id] = last
        self._num_cached_pages[seq_id] = num_full

    def free(self, seq_id: str) -> None:
        node = self._locked.pop(seq_id, None)
        self._num_cached_pages.pop(seq_id, None)
        if node is not None:
            self.cache.radix.dec_lock_ref(node)
        super().free(seq_id)

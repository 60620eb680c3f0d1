"""Block tables with prefix caching: a ``KVCacheManager`` whose full pages outlive their sequence.

A sequence starts from the longest cached prefix of its tokens (``match_prefix``), caches each page
it fills (``cache_pages``) and keeps the deepest cached node of its prefix locked until it is freed,
so no page in its block table can be evicted under it. Unlocked cached pages count as free: the
pool evicts them (policy of ``CacheStore``) before an allocation fails.

Provenance (see ``radix_cache``): a sequence matches exact pages, plus pages of the one approximate provenance
it accepts (its PIC backend's spec). It caches its pages as exact up to its exact limit (the first token whose
K/V an approximate combine made, or the first approximate page it matched) and as its provenance after it;
a sequence with no provenance does not cache pages past its exact limit.

Hybrid models (linear-attention state slots, with a ``state_io``): a cached prefix is usable only up to its
deepest node holding the linear-attention state after it, which a hit copies into the sequence's state slot.
One state is saved per prompt, at its *checkpoint*: the end of its last full page before its last token, the
longest prefix a later request can match (the same prompt again, or a longer conversation built on it). The
scheduler ends a prefill step there (``state_checkpoint``), so the state is in the slot right after that step;
page boundaries in between get no state: one costs ``state_io.num_pages`` pages, far more than a page of K/V.
"""

from __future__ import annotations

import sys

from nebula_engine.kvcache.cache_store import CacheStore
from nebula_engine.kvcache.page_blob import LinearStateIO
from nebula_engine.kvcache.pool import KVCacheError, KVCacheManager
from nebula_engine.kvcache.radix_cache import EXACT, TreeNode

ALL_EXACT = sys.maxsize  # exact limit of a sequence whose K/V is exact throughout


class PrefixCachingKVCacheManager(KVCacheManager):
    def __init__(self, cache: CacheStore, num_state_slots: int = 0, state_io: LinearStateIO | None = None):
        """Block tables over ``cache``'s pool. ``state_io``: a hybrid model's linear-attention states to and from
        pool pages; prefix matching with state slots needs it."""
        super().__init__(cache.pool, cache.page_size, num_state_slots)
        self.cache = cache
        self.state_io = state_io
        self._checkpoint: dict[str, int] = {}  # seq -> tokens after which its state is cached (hybrid models)
        self._restore: set[str] = set()  # seqs whose slot gets their matched node's state once they hold one
        self._locked: dict[str, TreeNode] = {}  # seq -> deepest cached node of its prefix (locked)
        self._num_cached_pages: dict[str, int] = {}  # leading pages of its block table in the tree
        self._provenance: dict[str, str] = {}  # seq -> approximate provenance it accepts and makes (absent: none)
        self._exact_limit: dict[str, int] = {}  # seq -> tokens before it whose K/V is exact (absent: all)

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages + self.cache.num_evictable_pages

    def match_prefix(self, seq_id: str, token_ids: list[int], provenance: str = EXACT) -> int:
        """Start ``seq_id``'s block table with the cached prefix of ``token_ids``; returns its tokens.

        ``provenance``: besides exact pages, the approximate ones the sequence accepts (its PIC backend's spec;
        ``EXACT``: none). The last token is never a hit: it must be computed to sample the next one.
        """
        if seq_id in self.block_tables:
            raise KVCacheError(f"sequence {seq_id!r} already has a block table")
        usable = token_ids[: len(token_ids) - 1]
        match = self.cache.radix.match_prefix(usable, provenance)
        if provenance:
            self._provenance[seq_id] = provenance
        self.cache.radix.inc_lock_ref(match.last_node)
        last, promoted = self.cache.promote_prefix(match.last_node, usable[len(match.pages) * self.page_size:])
        pages = match.pages + promoted
        # promoted pages continue the match's provenance: exact after exact pages
        num_exact = match.num_exact_pages + (0 if match.last_node.provenance else len(promoted))
        if self.state_slots is not None:
            last, pages = self._cut_to_state(seq_id, last, pages, len(usable))
        if num_exact < len(pages):
            self._exact_limit[seq_id] = num_exact * self.page_size
        self.pool.share(pages)
        self.block_tables[seq_id] = pages
        self._locked[seq_id] = last
        self._num_cached_pages[seq_id] = len(pages)
        return len(pages) * self.page_size

    def _cut_to_state(self, seq_id: str, last: TreeNode, pages: list[int], num_usable: int
                      ) -> tuple[TreeNode, list[int]]:
        """The part of a match a hybrid model can use: up to its deepest node with a state (locked in ``last``'s
        place); notes the state to restore and the sequence's checkpoint."""
        if self.state_io is None:
            raise KVCacheError("prefix matching on a model with linear-attention layers needs state_io")
        usable = self.cache.radix.deepest_with_state(last)
        if usable is not last:
            self.cache.radix.inc_lock_ref(usable)
            self.cache.radix.dec_lock_ref(last)
        depth, node = 0, usable
        while not node.is_root:
            depth, node = depth + 1, node.parent
        if depth:
            self._restore.add(seq_id)
        checkpoint = num_usable // self.page_size * self.page_size
        if checkpoint > depth * self.page_size:
            self._checkpoint[seq_id] = checkpoint
        return usable, pages[:depth]

    def state_checkpoint(self, seq_id: str) -> int:
        return self._checkpoint.get(seq_id, 0)

    def allocate_slots(self, seq_id: str, num_tokens: int) -> list[int]:
        new_pages = super().allocate_slots(seq_id, num_tokens)
        if seq_id in self._restore:  # its state slot is held now: start it from the matched prefix's state
            self._restore.discard(seq_id)
            self.state_io.load(list(self._locked[seq_id].state_pages), self.state_slots.slot_of[seq_id])
        return new_pages

    def loading(self, token_ids: list[int]) -> bool:
        """Whether part of the cached prefix of ``token_ids`` is still being read from disk."""
        usable = token_ids[: len(token_ids) - 1]
        match = self.cache.radix.match_prefix(usable)
        return self.cache.loading(match.last_node, usable[len(match.pages) * self.page_size:])

    def cache_pages(self, seq_id: str, token_ids: list[int], num_computed_tokens: int,
                    exact_tokens: int = ALL_EXACT) -> None:
        """Insert the pages ``seq_id`` has filled since the last call into the prefix tree.

        ``exact_tokens``: the sequence's K/V is exact only before this token (lowers its exact limit for good).
        """
        if exact_tokens < self._exact_limit.get(seq_id, ALL_EXACT):
            self._exact_limit[seq_id] = exact_tokens
        num_full = num_computed_tokens // self.page_size
        num_exact = min(num_full, self._exact_limit.get(seq_id, ALL_EXACT) // self.page_size)
        provenance = self._provenance.get(seq_id)
        done = self._num_cached_pages.get(seq_id, 0)
        parts = [(done, num_exact, EXACT), (max(done, num_exact), num_full if provenance else 0, provenance)]
        for start, end, kind in parts:
            if end <= start:
                continue
            node = self._locked.get(seq_id, self.cache.radix.root)
            tokens = token_ids[start * self.page_size: end * self.page_size]
            last = self.cache.insert_prefix(node, tokens, self.block_tables[seq_id][start:end], kind)
            self.cache.radix.dec_lock_ref(node)
            self._locked[seq_id] = last
            self._num_cached_pages[seq_id] = end
        checkpoint = self._checkpoint.get(seq_id, ALL_EXACT)
        if num_computed_tokens >= checkpoint:
            del self._checkpoint[seq_id]
        if num_computed_tokens == checkpoint and self._num_cached_pages[seq_id] * self.page_size == checkpoint:
            # the step that just ran ended at the checkpoint: the slot holds the state after its last page
            slot = self.state_slots.slot_of[seq_id]
            self.cache.save_node_state(self._locked[seq_id], lambda pages: self.state_io.save(slot, pages),
                                       self.state_io.num_pages)

    def free(self, seq_id: str) -> None:
        self._checkpoint.pop(seq_id, None)
        self._restore.discard(seq_id)
        node = self._locked.pop(seq_id, None)
        self._num_cached_pages.pop(seq_id, None)
        self._provenance.pop(seq_id, None)
        self._exact_limit.pop(seq_id, None)
        if node is not None:
            self.cache.radix.dec_lock_ref(node)
        super().free(seq_id)

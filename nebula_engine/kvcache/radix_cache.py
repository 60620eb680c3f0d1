"""Prefix cache: a page-aligned radix tree over token ids (SGLang ``RadixCache``, one page per node).

Each node below the root holds exactly one full page: its ``page_size`` token ids, the device page
with their K/V, and a ``block_hash`` chained on its parent's (so equal hashes mean equal prefixes).

Provenance: a node's ``provenance`` is ``EXACT`` ("") when its K/V is what a plain prefill computes, else the
spec of the PIC backend whose combine approximated it. Approximation spreads down a chain (a later token attends
to the approximate ones), so an exact node's children are exact or approximate, an approximate node's children
have its provenance. Children are keyed by (provenance, tokens): the same page may be cached once exact and once
per backend. ``match_prefix`` follows exact children only, unless it is given a provenance it also accepts; an
approximate node's ``block_hash`` mixes its provenance in, so no one who hashes token ids alone (the cluster
router) ever names approximate KV as an exact prefix.

Invariants:
- the tree holds one reference (``PagePool.ref_cnt``) on every page it caches; a request that uses
  cached pages takes its own reference and locks the deepest node it uses;
- ``lock_ref`` of a node counts the locks on it and on its descendants, so a locked node's whole
  path to the root is locked; only unlocked leaves are evicted, least recently used first;
- pages returned by ``match_prefix`` are only safe while the returned node is locked.

Hybrid models (linear-attention layers): a node may also hold ``state_pages``, the pages keeping the
linear-attention state after its last token (``page_blob``). The tree holds one reference on each; they count
in the node's size (one page's tokens each) and leave with the node. A prefix is usable by such a model only up
to its deepest node with a state (``deepest_with_state``).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import xxhash

from nebula_engine.kvcache.events import CacheKind, EventLog
from nebula_engine.kvcache.pool import KVCacheError, PagePool


EXACT = ""  # provenance of K/V a plain prefill computes


def block_hash(parent_hash: str, tokens: tuple[int, ...], provenance: str = EXACT) -> str:
    """Key of one page: chained on everything before it, so it names the whole prefix (and how it was made)."""
    tag = f"approx:{len(provenance)}:{provenance}:".encode() if provenance else b""
    return xxhash.xxh3_128_hexdigest(parent_hash.encode() + tag + np.asarray(tokens, dtype=np.int64).tobytes())


def root_hash(model_id: str) -> str:
    return xxhash.xxh3_128_hexdigest(f"pc-root:{model_id}".encode())


@dataclass(eq=False)
class TreeNode:
    tokens: tuple[int, ...]
    page: int
    block_hash: str
    parent: TreeNode | None
    provenance: str = EXACT
    children: dict[tuple[str, tuple[int, ...]], TreeNode] = field(default_factory=dict)  # by ``key``
    lock_ref: int = 0
    last_access: int = 0
    state_pages: tuple[int, ...] = ()  # linear-attention state after this page (hybrid models), in pool pages

    @property
    def is_root(self) -> bool:
        return self.page < 0

    @property
    def num_pages(self) -> int:
        return 1 + len(self.state_pages)

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return self.provenance, self.tokens


@dataclass(frozen=True)
class MatchResult:
    pages: list[int]  # cached pages of the prefix, in order; safe only while last_node is locked
    last_node: TreeNode
    num_exact_pages: int  # the leading pages whose K/V is exact; the rest has ``last_node.provenance``


class RadixCache:
    def __init__(self, pool: PagePool, page_size: int, events: EventLog, clock: Iterator[int],
                 model_id: str = "", demote: Callable[[TreeNode], bool] | None = None,
                 discard_lower: Callable[[CacheKind, str], None] | None = None):
        """``demote`` and ``discard_lower``: the lower tiers' hooks (``CacheStore`` passes them when it has tiers):
        take an evicted node's page (True: it moved, the hook emitted the event) and drop a stale lower copy of a
        key cached anew."""
        self.pool = pool
        self.page_size = page_size
        self.events = events
        self._clock = clock
        self.root = TreeNode((), -1, root_hash(model_id), None)
        self.evictable_size = 0  # tokens in unlocked nodes (each state page counted as a page of tokens)
        self.protected_size = 0  # tokens in locked nodes
        self._heap: list[tuple[int, int, TreeNode]] = []  # candidate leaves, lazily invalidated
        self._tiebreak = itertools.count()
        self._num_nodes = 0
        self.demote = demote
        self.discard_lower = discard_lower

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def match_prefix(self, token_ids: list[int], accept: str = EXACT) -> MatchResult:
        """Longest cached page-aligned prefix of ``token_ids`` made of exact K/V, continued by K/V of provenance
        ``accept`` where no exact page goes on (``EXACT``: exact only); marks its path recently used."""
        node, pages, num_exact = self.root, [], 0
        stamp = next(self._clock)
        for start in range(0, len(token_ids) - self.page_size + 1, self.page_size):
            tokens = tuple(token_ids[start:start + self.page_size])
            child = node.children.get((EXACT, tokens))
            if child is None and accept:
                child = node.children.get((accept, tokens))
            if child is None:
                break
            node = child
            pages.append(node.page)
            num_exact += not node.provenance
            self._touch(node, stamp)
        return MatchResult(pages, node, num_exact)

    def insert(self, node: TreeNode, token_ids: list[int], pages: list[int], promoted: bool = False,
               provenance: str = EXACT) -> TreeNode:
        """Cache full pages that continue ``node``'s prefix; returns the node of the last page.

        ``token_ids`` covers ``len(pages)`` full pages, all of ``provenance``. A page already cached keeps the
        tree's copy (the caller's duplicate stays the caller's); a new one gets the tree's own reference.
        ``promoted``: the pages came back from a lower tier, whose move event already says so.
        """
        if len(token_ids) != len(pages) * self.page_size:
            raise KVCacheError(f"{len(token_ids)} tokens do not fill {len(pages)} pages of {self.page_size}")
        if node.provenance and pages and provenance != node.provenance:
            raise KVCacheError(f"K/V of provenance {provenance or 'exact'!r} cannot continue approximate K/V "
                               f"of {node.provenance!r}")
        stamp = next(self._clock)
        parent_key = None
        new_keys: list[str] = []
        for index, page in enumerate(pages):
            tokens = tuple(token_ids[index * self.page_size:(index + 1) * self.page_size])
            child = node.children.get((provenance, tokens))
            if child is None:  # once a page is missing, every later page is new: one chain
                if not new_keys:
                    parent_key = None if node.is_root else node.block_hash
                child = self._add_child(node, tokens, page, provenance)
                new_keys.append(child.block_hash)
            node = child
            self._touch(node, stamp)
        if new_keys and not promoted:
            for key in new_keys if self.discard_lower else ():
                self.discard_lower(CacheKind.PC, key)
            self.events.store(CacheKind.PC, tuple(new_keys), len(new_keys) * self.page_size, parent_key=parent_key)
        return node

    def _add_child(self, parent: TreeNode, tokens: tuple[int, ...], page: int, provenance: str) -> TreeNode:
        self.pool.share([page])
        child = TreeNode(tokens, page, block_hash(parent.block_hash, tokens, provenance), parent, provenance)
        parent.children[child.key] = child
        self._num_nodes += 1
        self.evictable_size += self.page_size
        return child

    def attach_state(self, node: TreeNode, pages: list[int]) -> None:
        """Give ``node`` the pages holding the linear-attention state after its last token (the tree takes its
        own reference); a node keeps the first state it gets."""
        if node.is_root or node.state_pages or not pages:
            return
        self.pool.share(pages)
        node.state_pages = tuple(pages)
        if node.lock_ref:
            self.protected_size += len(pages) * self.page_size
        else:
            self.evictable_size += len(pages) * self.page_size

    @staticmethod
    def deepest_with_state(node: TreeNode) -> TreeNode:
        """``node`` or its deepest ancestor holding a state; the root (start from no state) when none does."""
        while not node.is_root and not node.state_pages:
            node = node.parent
        return node

    def _touch(self, node: TreeNode, stamp: int) -> None:
        node.last_access = stamp
        if not node.children and node.lock_ref == 0:
            heapq.heappush(self._heap, (stamp, next(self._tiebreak), node))

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors: none of them is evicted until ``dec_lock_ref``."""
        while not node.is_root:
            if node.lock_ref == 0:
                self.evictable_size -= node.num_pages * self.page_size
                self.protected_size += node.num_pages * self.page_size
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while not node.is_root:
            if node.lock_ref <= 0:
                raise KVCacheError(f"unlock of unlocked node {node.block_hash}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += node.num_pages * self.page_size
                self.protected_size -= node.num_pages * self.page_size
                self._touch(node, node.last_access)
            node = node.parent

    def oldest_evictable(self) -> int | None:
        """``last_access`` of the leaf ``evict_one`` would take, or None when nothing is evictable."""
        node = self._peek()
        return None if node is None else node.last_access

    def _peek(self) -> TreeNode | None:
        while self._heap:
            if self._is_candidate(self._heap[0]):
                return self._heap[0][2]
            heapq.heappop(self._heap)
        return None

    @staticmethod
    def _is_candidate(entry: tuple[int, int, TreeNode]) -> bool:
        stamp, _, node = entry
        return node.parent is not None and not node.children and node.lock_ref == 0 and node.last_access == stamp

    def evict_one(self) -> TreeNode | None:
        """Drop the least recently used unlocked leaf and release its page; None when none is left."""
        node = self._peek()
        if node is None:
            return None
        heapq.heappop(self._heap)
        parent = node.parent
        del parent.children[node.key]
        self._num_nodes -= 1
        self.evictable_size -= node.num_pages * self.page_size
        node.parent = None
        if self.demote is None or not self.demote(node):
            self.events.evict(CacheKind.PC, (node.block_hash,), self.page_size)
        self.pool.release([node.page, *node.state_pages])
        if not parent.is_root:
            self._touch(parent, parent.last_access)
        if len(self._heap) > 4 * self._num_nodes + 64:
            self._heap = [entry for entry in self._heap if self._is_candidate(entry)]
            heapq.heapify(self._heap)
        return node

    def nodes(self) -> Iterator[TreeNode]:
        """Every cached node, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        """Raise ``KVCacheError`` if the tree's structure, hashes, locks, pages or sizes disagree."""
        seen_pages, evictable, protected = set(), 0, 0
        for node in self.nodes():
            parent = node.parent
            if parent.children.get(node.key) is not node or len(node.tokens) != self.page_size:
                raise KVCacheError(f"node {node.block_hash} is not its parent's child for its page")
            if node.block_hash != block_hash(parent.block_hash, node.tokens, node.provenance):
                raise KVCacheError(f"node {node.block_hash} has a hash that does not chain on its parent")
            if parent.provenance and node.provenance != parent.provenance:
                raise KVCacheError(f"node {node.block_hash} ({node.provenance or 'exact'}) continues approximate "
                                   f"K/V of {parent.provenance!r}")
            if node.lock_ref < max((c.lock_ref for c in node.children.values()), default=0):
                raise KVCacheError(f"node {node.block_hash} is locked less than a descendant")
            for page in (node.page, *node.state_pages):
                if page in seen_pages or self.pool.ref_cnt[page] < 1:
                    raise KVCacheError(f"page {page} is cached twice or not referenced")
                seen_pages.add(page)
            if node.lock_ref:
                protected += node.num_pages * self.page_size
            else:
                evictable += node.num_pages * self.page_size
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise KVCacheError(f"sizes {(self.evictable_size, self.protected_size)} "
                               f"!= counted {(evictable, protected)}")

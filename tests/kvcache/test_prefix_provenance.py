"""Provenance of prefix-cache K/V: exact pages and each PIC backend's approximate pages never stand in for
one another (radix_cache's keys and hashes, the manager's exact limit)."""

import pytest

from nebula_engine.kvcache.cache_store import CacheStore
from nebula_engine.kvcache.pool import KVCacheError
from nebula_engine.kvcache.prefix_caching import PrefixCachingKVCacheManager
from nebula_engine.kvcache.radix_cache import EXACT, block_hash
from tests.kvcache.test_radix_and_pic import make_store

PAGE = 4


def cache(store, pool, tokens, exact_pages, provenance):
    """Cache ``tokens`` as ``exact_pages`` exact pages followed by pages of ``provenance``."""
    pages = pool.allocate(len(tokens) // PAGE)
    cut = exact_pages * PAGE
    node = store.insert_prefix(store.radix.root, tokens[:cut], pages[:exact_pages])
    last = store.insert_prefix(node, tokens[cut:], pages[exact_pages:], provenance)
    store.radix.dec_lock_ref(node)
    store.radix.dec_lock_ref(last)
    pool.release(pages)
    return pages


def test_exact_match_stops_at_approximate_pages_and_their_backend_continues():
    pool, store = make_store(num_pages=16)
    tokens = list(range(16))
    pages = cache(store, pool, tokens, exact_pages=1, provenance="naive")
    exact = store.radix.match_prefix(tokens)
    assert exact.pages == pages[:1] and exact.num_exact_pages == 1
    own = store.radix.match_prefix(tokens, accept="naive")
    assert own.pages == pages and own.num_exact_pages == 1 and own.last_node.provenance == "naive"
    assert store.radix.match_prefix(tokens, accept="epic:k=16").pages == pages[:1]
    store.check_integrity()


def test_exact_and_approximate_copies_of_one_page_coexist_and_exact_wins():
    pool, store = make_store(num_pages=16)
    tokens = list(range(8))
    approximate = cache(store, pool, tokens, exact_pages=0, provenance="naive")
    exact = cache(store, pool, tokens, exact_pages=2, provenance="naive")
    assert approximate != exact
    assert store.radix.match_prefix(tokens, accept="naive").pages == exact
    assert store.radix.total_size == 4 * PAGE
    store.check_integrity()


def test_approximate_hashes_differ_from_the_exact_chain_a_router_computes():
    assert block_hash("p", (1, 2), EXACT) == block_hash("p", (1, 2))
    assert block_hash("p", (1, 2), "naive") != block_hash("p", (1, 2))
    assert block_hash("p", (1, 2), "naive") != block_hash("p", (1, 2), "epic")
    pool, store = make_store(num_pages=16)
    cache(store, pool, list(range(8)), exact_pages=1, provenance="naive")
    root, first, second = store.radix.root.block_hash, (0, 1, 2, 3), (4, 5, 6, 7)
    exact_chain = block_hash(block_hash(root, first), second)
    keys = {key for _, key in store.snapshot().entries}
    assert block_hash(root, first) in keys and exact_chain not in keys


def test_exact_pages_cannot_continue_approximate_ones():
    pool, store = make_store(num_pages=16)
    cache(store, pool, list(range(8)), exact_pages=0, provenance="naive")
    node = store.radix.match_prefix(list(range(8)), accept="naive").last_node
    [page] = pool.allocate(1)
    with pytest.raises(KVCacheError, match="cannot continue approximate"):
        store.radix.insert(node, [8, 9, 10, 11], [page])


def test_manager_caches_exact_pages_before_the_limit_and_drops_approximate_ones_without_provenance():
    manager = PrefixCachingKVCacheManager(CacheStore(num_pages=32, page_size=PAGE))
    tokens = list(range(20))
    manager.match_prefix("a", tokens)
    manager.allocate_slots("a", len(tokens))
    manager.cache_pages("a", tokens, len(tokens), exact_tokens=9)  # no provenance: only the exact pages
    manager.free("a")
    assert manager.cache.radix.total_size == 2 * PAGE
    manager.match_prefix("b", tokens, "naive")
    manager.allocate_slots("b", len(tokens))
    manager.cache_pages("b", tokens, len(tokens), exact_tokens=9)
    manager.free("b")
    assert manager.match_prefix("c", tokens) == 2 * PAGE
    assert manager.match_prefix("d", tokens, "naive") == 4 * PAGE  # never the last token
    manager.cache.check_integrity()

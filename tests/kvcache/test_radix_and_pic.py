"""Exact behaviour of the prefix tree, the PIC store, the eviction policies and the event index."""

import pytest

from nebula_engine.kvcache.cache_store import CacheStore, CacheStoreConfig
from nebula_engine.kvcache.events import CacheIndex, CacheKind, EvictEvent, StoreEvent, Tier
from nebula_engine.kvcache.pic_store import segment_key
from nebula_engine.kvcache.pool import KVCacheError
from nebula_engine.kvcache.radix_cache import block_hash, root_hash


def make_store(num_pages=8, page_size=4, **config):
    store = CacheStore(num_pages, page_size, CacheStoreConfig(**config))
    return store.pool, store


def cache(store, pool, tokens):
    """Like a finished request: compute pages, cache them, drop the request's own references."""
    pages = pool.allocate(len(tokens) // store.page_size)
    node = store.insert_prefix(store.radix.root, tokens, pages)
    store.radix.dec_lock_ref(node)
    pool.release(pages)
    return pages


def test_match_is_page_aligned_and_stops_at_the_first_miss():
    pool, store = make_store()
    pages = cache(store, pool, list(range(8)))
    assert store.radix.match_prefix(list(range(7))).pages == pages[:1]
    assert store.radix.match_prefix(list(range(9))).pages == pages
    assert store.radix.match_prefix([0, 1, 2, 3, 9, 9, 9, 9]).pages == pages[:1]
    assert store.radix.match_prefix([9, 1, 2, 3]).pages == []


def test_duplicate_insert_keeps_the_tree_copy_and_leaves_the_callers_page_alone():
    pool, store = make_store()
    [tree_page] = cache(store, pool, [1, 2, 3, 4])
    [mine] = pool.allocate(1)
    node = store.insert_prefix(store.radix.root, [1, 2, 3, 4], [mine])
    assert node.page == tree_page and pool.ref_cnt[mine] == 1 and pool.ref_cnt[tree_page] == 1
    store.radix.dec_lock_ref(node)
    assert [type(e) for e in store.drain_events()] == [StoreEvent]


def test_unlocked_leaves_are_evicted_least_recently_used_first_and_parents_follow():
    pool, store = make_store(num_pages=8, page_size=2)
    a = cache(store, pool, [1, 1, 2, 2])
    b = cache(store, pool, [3, 3])
    c = cache(store, pool, [4, 4])
    store.radix.match_prefix([1, 1, 2, 2])  # a is now the most recent
    store.drain_events()
    assert store.evict(4) == 4
    evicted = [e.keys[0] for e in store.drain_events()]
    # b, c (oldest), then a's leaf, then a's root page (a leaf once its child is gone)
    h_a0 = block_hash(root_hash(""), (1, 1))
    assert evicted == [block_hash(root_hash(""), (3, 3)), block_hash(root_hash(""), (4, 4)),
                       block_hash(h_a0, (2, 2)), h_a0]
    assert pool.num_free_pages == 8 and len(a + b + c) == 4


def test_locked_path_survives_eviction():
    pool, store = make_store(num_pages=4, page_size=2)
    cache(store, pool, [1, 1, 2, 2])
    cache(store, pool, [5, 5])
    match = store.radix.match_prefix([1, 1, 2, 2])
    store.radix.inc_lock_ref(match.last_node)
    assert store.num_evictable_pages == 1
    assert store.evict(4) == 1
    assert store.radix.match_prefix([1, 1, 2, 2]).pages == match.pages
    store.radix.dec_lock_ref(match.last_node)
    with pytest.raises(KVCacheError, match="unlock of unlocked"):
        store.radix.dec_lock_ref(match.last_node)


def test_keys_name_model_and_whole_prefix_for_pc_but_only_content_for_pic():
    assert block_hash(root_hash("m1"), (1, 2)) != block_hash(root_hash("m2"), (1, 2))
    assert block_hash(block_hash(root_hash("m"), (7, 7)), (1, 2)) != block_hash(root_hash("m"), (1, 2))
    assert segment_key("m", "hypic", [1, 2, 3]) == segment_key("m", "hypic", [1, 2, 3])
    assert len({segment_key("m", "hypic", [1, 2, 3]), segment_key("m", "cacheblend", [1, 2, 3]),
                segment_key("m2", "hypic", [1, 2, 3]), segment_key("m", "hypic", [1, 2])}) == 4
    # pinned: keys must not change across processes or releases
    assert segment_key("m", "b", [1]) == "7eec1811bff7968d1e2d3ddd1d53c99d"


def test_pic_store_lookup_insert_lock_evict():
    pool, store = make_store(num_pages=6, page_size=4)
    first = store.insert_segment("k1", 6, pool.allocate(2), {"end_state": b"\x01"})
    second = store.insert_segment("k2", 3, pool.allocate(1))
    pool.release(list(first.pages) + list(second.pages))
    again = store.insert_segment("k1", 6, [])  # an existing key wins, nothing is allocated
    assert again is first and first.lock_ref == 2 and first.state == {"end_state": b"\x01"}
    store.pic.unlock(second)
    assert store.evict(6) == 1 and "k2" not in store.pic and store.pic.lookup("k1") is first
    store.pic.unlock(first)
    store.pic.unlock(first)
    assert store.evict(6) == 2 and len(store.pic) == 0 and pool.num_free_pages == 6


def test_soft_share_follows_p_and_retargeting_evicts_nothing():
    pool, store = make_store(num_pages=8, page_size=2, pc_share=0.5)
    cache(store, pool, [1, 1, 2, 2, 3, 3])  # 6 PC tokens
    entry = store.insert_segment("s", 2, pool.allocate(1))  # 2 PIC tokens
    pool.release(list(entry.pages))
    store.pic.unlock(entry)
    store.drain_events()
    store.set_pc_share(0.9)  # PC 6 <= 0.9 * 8: PIC goes first
    assert store.drain_events() == []
    store.evict(1)
    assert [e.kind for e in store.drain_events()] == [CacheKind.PIC]
    store.set_pc_share(0.1)
    store.evict(1)
    assert [e.kind for e in store.drain_events()] == [CacheKind.PC]


def test_unified_lru_and_fixed_partition():
    pool, store = make_store(num_pages=8, page_size=2, eviction_policy="unified-lru")
    entry = store.insert_segment("old", 2, pool.allocate(1))
    pool.release(list(entry.pages))
    store.pic.unlock(entry)
    cache(store, pool, [1, 1])
    store.drain_events()
    store.evict(1)
    assert [e.kind for e in store.drain_events()] == [CacheKind.PIC]
    # fixed-partition, PC share 0.25 of 16 tokens = 4: a third PC page pushes the oldest one out
    pool, store = make_store(num_pages=8, page_size=2, eviction_policy="fixed-partition", pc_share=0.25)
    cache(store, pool, [1, 1, 2, 2])
    store.drain_events()
    cache(store, pool, [7, 7])
    assert [type(e) for e in store.drain_events()] == [StoreEvent, EvictEvent]
    assert store.state().pc_tokens == 4
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_store(eviction_policy="lfu")


def test_index_replay_rejects_gaps_and_contradictions():
    index = CacheIndex(worker=1)
    index.apply(StoreEvent(1, 1, CacheKind.PIC, ("k",), 5))
    with pytest.raises(ValueError, match="does not follow"):
        index.apply(EvictEvent(1, 3, CacheKind.PIC, ("k",), 5))
    with pytest.raises(ValueError, match="index has"):
        index.apply(EvictEvent(1, 2, CacheKind.PIC, ("k",), 5, Tier.HOST))
    assert index.occupancy()[CacheKind.PIC, Tier.DEVICE] == 5

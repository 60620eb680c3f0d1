"""``CacheStore.evict_all`` pushes every unlocked entry down the tiers (what offline prefill relies on), and
``DiskTier.is_written`` tells a completed write from a pending or failed one."""

import torch

from nebula_engine.kvcache.cache_store import CacheStore
from nebula_engine.kvcache.disk_tier import DiskTier
from nebula_engine.kvcache.events import CacheIndex, CacheKind, EvictEvent, Tier
from nebula_engine.kvcache.page_io import StoragePageIO
from nebula_engine.kvcache.pool import KVCacheStorage
from nebula_engine.kvcache.spec import FullAttentionSpec, KVCacheGroupSpec
from nebula_engine.kvcache.tiers import TierConfig

PAGE_SIZE = 4


def store_with_storage(tiers: TierConfig | None, num_pages: int = 8) -> tuple[CacheStore, KVCacheStorage]:
    storage = KVCacheStorage([KVCacheGroupSpec((0,), FullAttentionSpec(1, 2, 2))], num_pages, PAGE_SIZE, "cpu")
    return CacheStore(num_pages, PAGE_SIZE, tiers=tiers, page_io=StoragePageIO(storage)), storage


def add_segment(store: CacheStore, storage: KVCacheStorage, key: str, num_tokens: int, value: float, locked=False):
    pages = store.pool.allocate(-(-num_tokens // PAGE_SIZE))
    for tensor in storage.layer_caches[0]:
        tensor[pages] = value
    entry = store.insert_segment(key, num_tokens, pages)
    store.pool.release(pages)
    if not locked:
        store.pic.unlock(entry)
    return entry


def add_prefix(store: CacheStore, tokens: list[int]) -> None:
    pages = store.pool.allocate(len(tokens) // PAGE_SIZE)
    node = store.insert_prefix(store.radix.root, tokens, pages)
    store.radix.dec_lock_ref(node)
    store.pool.release(pages)


def test_evict_all_moves_every_unlocked_entry_to_disk_and_keeps_locked_ones(tmp_path):
    store, storage = store_with_storage(TierConfig(disk_capacity_tokens=100, disk_path=str(tmp_path)))
    add_prefix(store, list(range(8)))
    add_segment(store, storage, "a", 5, 1.0)
    locked = add_segment(store, storage, "b", 3, 2.0, locked=True)
    assert store.evict_all() == 3  # two prefix pages and segment "a"
    assert [entry.key for entry in store.pic.entries()] == ["b"] and not list(store.radix.nodes())
    assert store.pool.num_free_pages == 8 - len(locked.pages)
    assert store.tiers.tier_of(CacheKind.PIC, "a") is Tier.DISK
    index = CacheIndex(worker=0)
    for event in store.drain_events():
        index.apply(event)
    assert index == store.snapshot()
    store.flush()
    assert store.tiers.disk.is_written("pic", "a")
    store.pic.unlock(locked)
    assert store.evict_all() == 1 and store.evict_all() == 0
    store.close()

    restarted, restarted_storage = store_with_storage(TierConfig(disk_capacity_tokens=100, disk_path=str(tmp_path)))
    entry = restarted.lookup_segment("a", 5)
    k, _ = restarted_storage.layer_caches[0]
    assert entry is not None and torch.all(k[list(entry.pages)] == 1.0)
    restarted.close()


def test_evict_all_without_tiers_drops_entries():
    store, storage = store_with_storage(None)
    add_segment(store, storage, "a", 4, 1.0)
    assert store.evict_all() == 1 and store.pool.num_free_pages == 8
    assert [type(e) for e in store.drain_events()][-1] is EvictEvent


def test_is_written_only_once_the_write_completed(tmp_path):
    disk = DiskTier(tmp_path / "ok", capacity_tokens=10)
    disk.put("pic", "k", 2, {"pages": [torch.ones(2)]})
    assert ("pic", "k") in disk
    disk.flush()
    assert disk.is_written("pic", "k") and not disk.is_written("pic", "other")
    disk.close()

    blocked = tmp_path / "blocked"
    failing = DiskTier(blocked, capacity_tokens=10)
    (blocked / ".pic-k.kv.tmp").mkdir()  # the writer's temporary file cannot be created: the write fails
    failing.put("pic", "k", 2, {"pages": [torch.ones(2)]})
    failing.flush()
    assert ("pic", "k") in failing and not failing.is_written("pic", "k")
    failing.close()

"""States kept in pool pages: the byte layout (``page_blob``), a prefix node's linear-attention state and a PIC
segment's backend state, counted in the stores' sizes, evicted with their entry and moved through the tiers."""

import pytest
import torch

from nebula_engine.kvcache.cache_store import CacheStore
from nebula_engine.kvcache.disk_tier import DiskTier
from nebula_engine.kvcache.events import CacheIndex, Tier
from nebula_engine.kvcache.page_blob import (LinearStateIO, PageBlobIO, TensorLayout, TensorRef, pack_tensors,
                                             unpack_tensors)
from nebula_engine.kvcache.page_io import StoragePageIO
from nebula_engine.kvcache.pool import KVCacheError, KVCacheStorage
from nebula_engine.kvcache.spec import FullAttentionSpec, KVCacheGroupSpec, LinearStateSpec, bytes_per_page
from nebula_engine.kvcache.tiers import TierConfig

PAGE_SIZE = 4
# one attention layer: a page is 4 tokens x 1 head x (2 + 2) x 4 bytes = 64 bytes;
# two linear layers: a state is 2 x (conv 3 x 2 x 4 + recurrent 2 x 2 x 3 x 4) = 2 x 72 = 144 bytes = 3 pages
GROUPS = [KVCacheGroupSpec((0,), FullAttentionSpec(1, 2, 2)),
          KVCacheGroupSpec((0, 1), LinearStateSpec(conv_channels=3, conv_width=2, num_heads=2, head_k_dim=2,
                                                   head_v_dim=3))]


def make(num_pages=16, tiers=None):
    storage = KVCacheStorage(GROUPS, num_pages, PAGE_SIZE, "cpu", num_state_slots=2)
    store = CacheStore(num_pages, PAGE_SIZE, tiers=tiers, page_io=StoragePageIO(storage),
                       blob_io=PageBlobIO(storage))
    return storage, store.pool, store


def random_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.randn(7, generator=g),
            torch.randint(0, 1 << 40, (3,), generator=g)]


def test_tensors_of_any_dtype_round_trip_through_pages_and_leave_other_pages_alone():
    storage, pool, _ = make()
    blob = PageBlobIO(storage)
    assert blob.page_bytes == bytes_per_page(GROUPS, PAGE_SIZE) == 64
    tensors = random_tensors(0)
    nbytes = sum(TensorLayout.of(t).nbytes for t in tensors)  # 30 + 28 + 24 = 82 bytes: two pages
    assert blob.pages_for(nbytes) == 2
    before = [t.clone() for t in storage.layer_caches[0]]
    blob.write([5, 2], tensors)
    back = blob.read([5, 2], [TensorLayout.of(t) for t in tensors])
    for original, restored in zip(tensors, back):
        assert restored.dtype == original.dtype and torch.equal(restored, original)
    others = [p for p in range(16) if p not in (5, 2)]
    for old, new in zip(before, storage.layer_caches[0]):  # as bytes: the pool starts uninitialized (NaNs)
        assert torch.equal(old[others].view(torch.uint8), new[others].view(torch.uint8))
    with pytest.raises(KVCacheError, match="do not fit"):
        blob.write([1], tensors)


def test_pack_replaces_tensors_by_refs_and_unpack_restores_the_structure():
    state = {"seam": 4, "linear": [{"conv": torch.ones(2), "M": torch.zeros(1, 2, 2)}, {"conv": torch.ones(3)}]}
    skeleton, tensors = pack_tensors(state)
    assert skeleton["seam"] == 4 and skeleton["linear"][1] == {"conv": TensorRef(2)} and len(tensors) == 3
    again = unpack_tensors(skeleton, tensors)
    assert again["linear"][0]["M"] is tensors[1] and again["seam"] == 4


def test_linear_state_io_copies_a_slot_through_pages_into_another_slot():
    storage, pool, _ = make()
    states = LinearStateIO(PageBlobIO(storage), storage.linear_states)
    spec = GROUPS[1].spec
    assert states.num_pages == -(-2 * spec.slot_bytes() // 64) == 3
    for conv, recurrent in storage.linear_states:
        conv[0].normal_()
        recurrent[0].normal_()
    states.save(0, [7, 3, 9])
    states.load([7, 3, 9], 1)
    for conv, recurrent in storage.linear_states:
        assert torch.equal(conv[1], conv[0]) and torch.equal(recurrent[1], recurrent[0])


def cache_prefix(store, pool, tokens, state_of=None):
    """A finished request's pages cached; ``state_of``: write a state (3 pages) after its last page."""
    pages = pool.allocate(len(tokens) // PAGE_SIZE)
    node = store.insert_prefix(store.radix.root, tokens, pages)
    if state_of is not None:
        assert store.save_node_state(node, state_of, 3)
    store.radix.dec_lock_ref(node)
    pool.release(pages)
    return node


def test_a_node_state_counts_in_sizes_and_is_released_with_its_node():
    storage, pool, store = make()
    written = []
    node = cache_prefix(store, pool, list(range(8)), state_of=written.append)
    assert len(written) == 1 and node.state_pages == tuple(written[0]) and len(node.state_pages) == 3
    assert pool.num_pages - pool.num_free_pages == 2 + 3
    assert store.radix.total_size == (2 + 3) * PAGE_SIZE == store.num_evictable_pages * PAGE_SIZE
    assert not store.save_node_state(node, written.append, 3)  # a node keeps its first state
    deeper = store.radix.match_prefix(list(range(8))).last_node
    assert store.radix.deepest_with_state(deeper) is node
    assert store.radix.deepest_with_state(node.parent) is store.radix.root
    store.check_integrity()
    assert store.evict(16) == 5 and pool.num_free_pages == 16
    assert store.radix.total_size == 0


def test_no_room_for_a_state_changes_nothing():
    storage, pool, store = make(num_pages=4)
    node = cache_prefix(store, pool, list(range(8)))
    held = pool.allocate(2)  # the rest of the pool: the node's path is locked while its state is written
    store.radix.inc_lock_ref(node)
    assert not store.save_node_state(node, lambda pages: None, 3)
    assert node.state_pages == () and pool.num_free_pages == 0 and store.radix.total_size == 2 * PAGE_SIZE
    store.radix.dec_lock_ref(node)
    pool.release(held)
    store.check_integrity()


def test_a_node_state_goes_to_the_host_tier_by_its_pages_and_comes_back(tmp_path):
    storage, pool, store = make(tiers=TierConfig(host_capacity_tokens=64))
    state_io = LinearStateIO(store.blob_io, storage.linear_states)
    for conv, recurrent in storage.linear_states:
        conv[0].normal_()
        recurrent[0].normal_()
    tokens = list(range(8))
    node = cache_prefix(store, pool, tokens, state_of=lambda pages: state_io.save(0, pages))
    store.evict_all()
    assert pool.num_free_pages == 16
    assert store.tiers.host.used_tokens == PAGE_SIZE + (PAGE_SIZE + 3 * PAGE_SIZE)  # the leaf carries the state
    match = store.radix.match_prefix(tokens)
    store.radix.inc_lock_ref(match.last_node)
    last, pages = store.promote_prefix(match.last_node, tokens)
    assert len(pages) == 2 and len(last.state_pages) == 3 and store.tiers.host.used_tokens == 0
    state_io.load(list(last.state_pages), 1)
    for conv, recurrent in storage.linear_states:
        assert torch.equal(conv[1], conv[0]) and torch.equal(recurrent[1], recurrent[0])
    store.radix.dec_lock_ref(last)
    store.check_integrity()
    index = CacheIndex(worker=0)
    for event in store.drain_events():
        index.apply(event)
    assert index == store.snapshot() and node.state_pages  # the evicted node object kept its (stale) tuple


def hypic_like_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"position_offset": 0, "seam": 4,
            "linear": [{"conv": torch.randn(3, 2, generator=g), "M": torch.randn(2, 2, 2, generator=g),
                        "N": torch.randn(2, 2, 3, generator=g)} for _ in range(2)]}


def assert_same_state(got, want):
    assert got["seam"] == want["seam"] and got["position_offset"] == want["position_offset"]
    for a, b in zip(got["linear"], want["linear"], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_pic_segment_state_lives_in_pages_counted_evicted_and_tiered():
    storage, pool, store = make(tiers=TierConfig(host_capacity_tokens=64))
    state = hypic_like_state(0)  # 2 x (24 + 32 + 48) = 208 bytes: 4 pages
    pages = pool.allocate(2)
    entry = store.insert_segment("seg", 6, pages, state)
    pool.release(pages)
    assert len(entry.state_pages) == 4 and pool.num_pages - pool.num_free_pages == 2 + 4
    assert not any(isinstance(v, torch.Tensor) for layer in entry.stored_state["linear"] for v in layer.values())
    assert_same_state(entry.state, state)
    assert store.pic.total_size == 6 + 4 * PAGE_SIZE
    store.pic.unlock(entry)
    assert store.num_evictable_pages == 6
    store.check_integrity()
    assert store.evict(16) == 6 and pool.num_free_pages == 16
    assert store.tiers.host.used_tokens == 6 + 4 * PAGE_SIZE
    back = store.lookup_segment("seg", 6)
    assert back is not None and len(back.state_pages) == 4 and pool.num_pages - pool.num_free_pages == 6
    assert_same_state(back.state, state)
    store.pic.unlock(back)
    store.check_integrity()


def test_a_pic_state_without_room_for_its_pages_is_kept_and_counted():
    storage, pool, store = make(num_pages=3)
    pages = pool.allocate(2)
    entry = store.insert_segment("seg", 6, pages, hypic_like_state(1))
    pool.release(pages)
    assert entry.state_pages == () and store.num_states_outside_pages == 1
    assert_same_state(entry.state, hypic_like_state(1))
    store.pic.unlock(entry)
    store.check_integrity()


def test_a_pic_state_on_the_disk_tier_is_charged_by_its_pages(tmp_path):
    storage, pool, store = make(tiers=TierConfig(disk_capacity_tokens=100, disk_path=str(tmp_path)))
    pages = pool.allocate(2)
    entry = store.insert_segment("seg", 6, pages, hypic_like_state(2))
    pool.release(pages)
    store.pic.unlock(entry)
    store.evict_all()
    store.flush()
    assert store.tiers.disk.used_tokens == 6 + 4 * PAGE_SIZE
    restarted = DiskTier(tmp_path, 100)
    assert restarted.used_tokens == 6 + 4 * PAGE_SIZE  # the charge survives a restart
    restarted.close()
    assert store.snapshot().entries[next(iter(store.snapshot().entries))].tier is Tier.DISK
    back = store.lookup_segment("seg", 6)
    assert_same_state(back.state, hypic_like_state(2))
    store.pic.unlock(back)
    store.close()

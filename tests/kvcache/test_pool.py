import random

import pytest
import torch

from nebula_engine.kvcache.pool import (KVCacheError, KVCacheManager, KVCacheStorage, OutOfPagesError, PagePool,
                                        num_pages_for_budget)
from nebula_engine.kvcache.spec import FullAttentionSpec, KVCacheGroupSpec, bytes_per_page, full_attention_groups


def test_page_pool_hands_out_lowest_free_ids_first():
    pool = PagePool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.release([1])
    assert pool.allocate(2) == [1, 3]
    assert pool.num_free_pages == 0


def test_allocation_is_all_or_nothing():
    pool = PagePool(3)
    pool.allocate(2)
    with pytest.raises(OutOfPagesError) as err:
        pool.allocate(2)
    assert (err.value.needed, err.value.free) == (2, 1)
    assert pool.num_free_pages == 1


def test_double_free_is_an_error():
    pool = PagePool(2)
    pages = pool.allocate(1)
    pool.release(pages)
    with pytest.raises(KVCacheError, match="double free of page 0"):
        pool.release(pages)


def test_shared_page_returns_to_free_list_after_last_release():
    pool = PagePool(2)
    [page] = pool.allocate(1)
    pool.share([page])
    assert pool.ref_cnt[page] == 2
    pool.release([page])
    assert pool.num_free_pages == 1
    pool.release([page])
    assert pool.num_free_pages == 2


def test_block_table_grows_page_by_page():
    kv = KVCacheManager(PagePool(8), page_size=4)
    assert kv.allocate_slots("a", 5) == [0, 1]
    assert kv.allocate_slots("a", 8) == []
    assert kv.allocate_slots("a", 9) == [2]
    assert kv.block_tables["a"] == [0, 1, 2]
    assert kv.can_allocate("b", 20) and not kv.can_allocate("b", 21)
    kv.free("a")
    assert kv.num_free_pages == 8 and "a" not in kv.block_tables
    with pytest.raises(KVCacheError, match="holds no pages"):
        kv.free("a")


def test_out_of_pages_leaves_block_table_unchanged():
    kv = KVCacheManager(PagePool(2), page_size=4)
    kv.allocate_slots("a", 4)
    with pytest.raises(OutOfPagesError):
        kv.allocate_slots("a", 12)
    assert kv.block_tables["a"] == [0] and kv.num_free_pages == 1


def _check_invariants(kv: KVCacheManager) -> None:
    refs = [0] * kv.pool.num_pages
    for table in kv.block_tables.values():
        for page in table:
            refs[page] += 1
    assert refs == kv.pool.ref_cnt
    used = sum(1 for r in refs if r > 0)
    assert used + kv.num_free_pages == kv.pool.num_pages
    assert len(set(kv.pool._free)) == kv.num_free_pages
    assert all(refs[p] == 0 for p in kv.pool._free)


@pytest.mark.parametrize("seed", range(5))
def test_random_alloc_free_keeps_accounting_exact(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(PagePool(32), page_size=4)
    lengths: dict[str, int] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.5:
            seq = rng.choice(list(lengths) + [f"s{step}"])
            target = lengths.get(seq, 0) + rng.randint(1, 9)
            try:
                kv.allocate_slots(seq, target)
                lengths[seq] = target
            except OutOfPagesError:
                pass
        elif lengths:
            seq = rng.choice(list(lengths))
            kv.free(seq)
            del lengths[seq]
        _check_invariants(kv)
    for seq in list(lengths):
        kv.free(seq)
    assert kv.num_free_pages == 32 and all(r == 0 for r in kv.pool.ref_cnt)


def test_groups_split_layers_by_shape_and_size_the_pool_from_a_budget():
    groups = full_attention_groups([(2, 16, 16), (1, 8, 8), (2, 16, 16)], torch.float32)
    assert [g.layer_indices for g in groups] == [(0, 2), (1,)]
    # per page of 4 tokens: 2 layers * 4 * 2 * 32 * 4 B + 1 layer * 4 * 1 * 16 * 4 B
    assert bytes_per_page(groups, 4) == 2048 + 256
    assert num_pages_for_budget(groups, 4, 10 * 2304 + 5) == 10
    with pytest.raises(ValueError, match="smaller than one page"):
        num_pages_for_budget(groups, 4, 100)


def test_storage_allocates_per_layer_tensors():
    groups = [KVCacheGroupSpec((0, 1), FullAttentionSpec(2, 8, 4))]
    storage = KVCacheStorage(groups, num_pages=3, page_size=4, device="cpu")
    k, v = storage.layer_caches[1]
    assert k.shape == (3, 4, 2, 8) and v.shape == (3, 4, 2, 4)


def test_freed_pages_come_back_as_consecutive_runs():
    """Attention reads consecutive pages in place, so freeing must not scramble the free list."""
    kv = KVCacheManager(PagePool(8), page_size=4)
    kv.allocate_slots("a", 16)
    kv.allocate_slots("b", 16)
    kv.free("b")
    kv.free("a")
    assert kv.allocate_slots("c", 32) == [0, 1, 2, 3, 4, 5, 6, 7]

import pytest

from nebula_engine.cluster.messages import CacheKind
from nebula_engine.cluster.worker_cache import WorkerCache

PC, PIC = CacheKind.PC, CacheKind.PIC


def fill(cache: WorkerCache, entries):
    evicted = []
    for kind, key, tokens in entries:
        evicted += cache.store(kind, key, tokens)[1]
    return evicted


def test_soft_share_evicts_pc_while_pc_over_share():
    cache = WorkerCache(400, "soft-share", pc_share=0.25)
    evicted = fill(cache, [(PC, "p1", 100), (PC, "p2", 100), (PIC, "a", 100), (PIC, "b", 100),
                           (PIC, "c", 100)])
    assert evicted == [(PC, "p1")]  # PC holds 200/500 > 0.25: PC pays, oldest first


def test_soft_share_evicts_pic_when_pc_within_share():
    cache = WorkerCache(400, "soft-share", pc_share=0.75)
    evicted = fill(cache, [(PC, "p1", 100), (PIC, "a", 100), (PIC, "b", 100), (PIC, "c", 100),
                           (PC, "p2", 100)])
    assert evicted == [(PIC, "a")]


def test_unified_lru_evicts_oldest_of_either_type():
    cache = WorkerCache(300, "unified-lru")
    fill(cache, [(PIC, "a", 100), (PC, "p", 100), (PIC, "b", 100)])
    cache.touch(PIC, "a")
    assert fill(cache, [(PIC, "c", 100)]) == [(PC, "p")]


def test_fixed_partition_never_borrows():
    cache = WorkerCache(400, "fixed-partition", pc_share=0.5)
    evicted = fill(cache, [(PIC, "a", 100), (PIC, "b", 100), (PIC, "c", 100)])
    assert evicted == [(PIC, "a")]  # PIC is over its 200 even though PC is empty
    assert cache.used == {PC: 0, PIC: 200}


@pytest.mark.parametrize("rule", ["soft-share", "unified-lru", "fixed-partition"])
def test_budget_never_exceeded(rule):
    cache = WorkerCache(1000, rule)
    for i in range(200):
        cache.store(PC if i % 3 else PIC, f"k{i}", 37 + i % 50)
        assert cache.used[PC] + cache.used[PIC] <= 1000


def test_restore_refreshes_instead_of_duplicating():
    cache = WorkerCache(1000)
    assert cache.store(PIC, "a", 10) == (True, [])
    assert cache.store(PIC, "a", 10) == (False, [])
    assert cache.used[PIC] == 10


def test_unknown_rule_rejected():
    with pytest.raises(ValueError, match="unknown eviction rule"):
        WorkerCache(10, "fifo")


def test_running_jobs_pin_pool_space():
    cache = WorkerCache(300)
    fill(cache, [(PIC, "a", 100), (PIC, "b", 100), (PIC, "c", 100)])
    assert cache.pin(150) == [(PIC, "a"), (PIC, "b")]
    assert cache.store(PIC, "d", 100)[1] == [(PIC, "c")]
    cache.unpin(150)
    assert cache.store(PIC, "e", 100)[1] == []

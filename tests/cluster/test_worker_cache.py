import pytest

from nebula_engine.cluster.control.messages import CacheKind, Tier
from nebula_engine.cluster.sim.worker_cache import CacheChange, WorkerCache

PC, PIC = CacheKind.PC, CacheKind.PIC
DEVICE, HOST = Tier.DEVICE, Tier.HOST


def dropped(changes: list[CacheChange]) -> list[tuple[CacheKind, str]]:
    """Entries that left the device."""
    return [(c.kind, c.key) for c in changes if c.src is DEVICE]


def fill(cache: WorkerCache, entries) -> list[tuple[CacheKind, str]]:
    out = []
    for kind, key, tokens in entries:
        out += dropped(cache.store(kind, key, tokens))
    return out


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
    cache = WorkerCache(1000, rule, host_capacity_tokens=500)
    for i in range(200):
        cache.store(PC if i % 3 else PIC, f"k{i}", 37 + i % 50)
        assert cache.used[PC] + cache.used[PIC] <= 1000
        assert sum(cache.host.used.values()) <= 500


def test_restore_refreshes_instead_of_duplicating():
    cache = WorkerCache(1000)
    assert cache.store(PIC, "a", 10) == [CacheChange(PIC, "a", 10, None, DEVICE)]
    assert cache.store(PIC, "a", 10) == []
    assert cache.used[PIC] == 10


def test_unknown_rule_rejected():
    with pytest.raises(ValueError, match="unknown eviction rule"):
        WorkerCache(10, "fifo")


def test_running_jobs_pin_pool_space():
    cache = WorkerCache(300)
    fill(cache, [(PIC, "a", 100), (PIC, "b", 100), (PIC, "c", 100)])
    assert dropped(cache.pin(150)) == [(PIC, "a"), (PIC, "b")]
    assert dropped(cache.store(PIC, "d", 100)) == [(PIC, "c")]
    cache.unpin(150)
    assert cache.store(PIC, "e", 100) == [CacheChange(PIC, "e", 100, None, DEVICE)]


def test_eviction_demotes_to_host_and_host_drops_its_overflow():
    cache = WorkerCache(200, "unified-lru", host_capacity_tokens=150)
    fill(cache, [(PIC, "a", 100), (PIC, "b", 100)])
    assert cache.store(PIC, "c", 100) == [CacheChange(PIC, "c", 100, None, DEVICE),
                                          CacheChange(PIC, "a", 100, DEVICE, HOST)]
    assert cache.tier_of(PIC, "a") is HOST and not cache.has(PIC, "a")
    assert cache.store(PIC, "d", 100) == [CacheChange(PIC, "d", 100, None, DEVICE),
                                          CacheChange(PIC, "b", 100, DEVICE, HOST),
                                          CacheChange(PIC, "a", 100, HOST, None)]


def test_promotion_moves_a_host_copy_back_and_a_fresh_copy_replaces_it():
    cache = WorkerCache(100, "unified-lru", host_capacity_tokens=300)
    fill(cache, [(PIC, "a", 100), (PIC, "b", 100)])
    assert cache.promote(PIC, "a") == [CacheChange(PIC, "a", 100, HOST, DEVICE),
                                       CacheChange(PIC, "b", 100, DEVICE, HOST)]
    assert cache.store(PIC, "b", 100)[0] == CacheChange(PIC, "b", 100, HOST, None)  # the lower copy goes
    assert cache.tier_of(PIC, "b") is DEVICE


@pytest.mark.parametrize("host_share, victim", [(0.0, (PC, "p")), (1.0, (PIC, "a"))])
def test_each_tier_evicts_with_its_own_share(host_share, victim):
    cache = WorkerCache(100, "soft-share", host_capacity_tokens=200)
    cache.set_shares({DEVICE: 0.0, HOST: host_share})
    fill(cache, [(PC, "p", 100), (PIC, "a", 100), (PIC, "b", 100)])  # p then a demoted to the host
    changes = cache.store(PIC, "c", 100)  # b demoted: the host is over its budget
    assert [(c.kind, c.key) for c in changes if c.src is HOST] == [victim]

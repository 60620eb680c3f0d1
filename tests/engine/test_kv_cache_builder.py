"""``build_kv_cache``: the parts an engine's config asks for, each given its collaborators when it is built."""

import pytest
import torch

from nebula_engine.config import CacheConfig, SchedulerConfig
from nebula_engine.engine.kv_cache_builder import build_kv_cache
from nebula_engine.engine.scheduler import Scheduler
from nebula_engine.kvcache.cache_store import CacheStore
from nebula_engine.kvcache.pool import KVCacheManager, OutOfPagesError, PagePool
from nebula_engine.kvcache.prefix_caching import PrefixCachingKVCacheManager
from nebula_engine.kvcache.spec import FullAttentionSpec, KVCacheGroupSpec, LinearStateSpec, full_attention_groups

PLAIN = full_attention_groups([(2, 2, 4)], torch.float32)
HYBRID = [KVCacheGroupSpec((0,), FullAttentionSpec(2, 8, 8)),
          KVCacheGroupSpec((0, 1), LinearStateSpec(conv_channels=4, conv_width=2, num_heads=2, head_k_dim=2,
                                                   head_v_dim=2))]


def build(groups=PLAIN, num_state_slots=0, with_pic=False, **cache):
    return build_kv_cache(CacheConfig(page_size=4, **cache), groups, 8, num_state_slots, "cpu", "model:fp32", with_pic)


def test_without_prefix_caching_or_pic_a_plain_manager_owns_the_pool():
    kv = build(enable_prefix_caching=False)
    assert type(kv.manager) is KVCacheManager and kv.cache_store is None and kv.prefix_cache is None
    assert kv.manager.pool.num_pages == kv.storage.num_pages == 8 and kv.manager.pool.reclaimer is None


def test_prefix_caching_shares_the_store_pool_and_evicts_through_the_store():
    kv = build(worker_id=5)
    store = kv.cache_store
    assert isinstance(kv.manager, PrefixCachingKVCacheManager) and kv.prefix_cache is kv.manager
    assert kv.manager.cache is store and kv.manager.pool is store.pool and store.pool.reclaimer == store.evict
    assert store.config.worker_id == 5 and store.config.model_id == "model:fp32"
    assert store.tiers is None and store.page_io is not None and store.blob_io is not None
    assert kv.manager.state_io is None


def test_pic_alone_keeps_the_store_but_matches_no_prefixes():
    kv = build(enable_prefix_caching=False, with_pic=True)
    assert kv.cache_store is kv.manager.cache and kv.prefix_cache is None


def test_tiers_and_hybrid_state_io_are_built_in():
    kv = build(HYBRID, num_state_slots=2, host_cache_tokens=64)
    assert kv.cache_store.tiers is not None and kv.cache_store.tiers.host.capacity_tokens == 64
    assert kv.manager.state_io is not None and kv.manager.state_io.linear_states is kv.storage.linear_states
    assert kv.manager.state_slots.num_slots == 2


def test_a_pool_reclaimer_is_called_with_the_shortfall():
    asked = []
    pool = PagePool(2, reclaimer=asked.append)
    pool.allocate(2)
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    assert asked == [1]


def test_tiers_without_page_io_are_refused():
    from nebula_engine.kvcache.tiers import TierConfig

    with pytest.raises(ValueError, match="page_io"):
        CacheStore(8, 4, tiers=TierConfig(host_capacity_tokens=8))


def test_the_scheduler_prefix_cache_is_its_kv_cache():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16)
    manager = PrefixCachingKVCacheManager(CacheStore(8, 4))
    assert Scheduler(config, manager, manager).prefix_cache is manager
    assert Scheduler(config, manager).prefix_cache is None
    with pytest.raises(ValueError, match="kv_cache itself"):
        Scheduler(config, manager, PrefixCachingKVCacheManager(CacheStore(8, 4)))

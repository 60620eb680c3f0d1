"""Builds an engine's KV cache, each part before the parts that use it, so none is attached after construction.

Order: the storage (the pool's tensors); the page and state I/O over it; the ``CacheStore``, which owns the page
pool and is its reclaimer; the block-table manager the scheduler allocates from. Prefix caching and the PIC store
share the one ``CacheStore``; with linear-attention layers a cached prefix also keeps the state after it, in pool
pages (``prefix_caching``). With both off there is no ``CacheStore``: a plain ``KVCacheManager`` owns the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nebula_engine.config import CacheConfig
from nebula_engine.kvcache.cache_store import CacheStore, CacheStoreConfig
from nebula_engine.kvcache.page_blob import LinearStateIO, PageBlobIO
from nebula_engine.kvcache.page_io import StoragePageIO
from nebula_engine.kvcache.pool import KVCacheManager, KVCacheStorage, PagePool
from nebula_engine.kvcache.prefix_caching import PrefixCachingKVCacheManager
from nebula_engine.kvcache.spec import KVCacheGroupSpec
from nebula_engine.kvcache.tiers import TierConfig


@dataclass(frozen=True)
class KVCache:
    storage: KVCacheStorage  # the tensors: the model runner's side
    manager: KVCacheManager  # block tables: the scheduler's side
    cache_store: CacheStore | None  # prefix cache and PIC store; None when both are off
    prefix_cache: PrefixCachingKVCacheManager | None  # ``manager``, when prefix matching is on


def build_kv_cache(config: CacheConfig, groups: list[KVCacheGroupSpec], num_pages: int, num_state_slots: int,
                   device: torch.device | str, model_id: str, with_pic: bool) -> KVCache:
    """The KV cache of an engine whose cache keys carry ``model_id``. ``num_state_slots``: linear-attention state
    slots (0 without such layers); ``with_pic``: the engine serves a PIC backend, which needs the ``CacheStore``
    even with prefix caching off."""
    storage = KVCacheStorage(groups, num_pages, config.page_size, device, num_state_slots)
    if not config.enable_prefix_caching and not with_pic:
        return KVCache(storage, KVCacheManager(PagePool(num_pages), config.page_size, num_state_slots), None, None)
    blob_io = PageBlobIO(storage)
    store = CacheStore(num_pages, config.page_size,
                       CacheStoreConfig(config.worker_id, model_id, config.eviction_policy, config.pc_share),
                       _tier_config(config), StoragePageIO(storage), blob_io)
    state_io = LinearStateIO(blob_io, storage.linear_states) if num_state_slots else None
    manager = PrefixCachingKVCacheManager(store, num_state_slots, state_io)
    return KVCache(storage, manager, store, manager if config.enable_prefix_caching else None)


def _tier_config(config: CacheConfig) -> TierConfig | None:
    if not config.host_cache_tokens and not config.disk_cache_tokens:
        return None
    return TierConfig(config.host_cache_tokens, config.disk_cache_tokens, config.disk_cache_path,
                      config.demote_on_evict)

"""Linear-attention state slots: one per sequence, taken with its first pages, given back with them."""

import random

import pytest
import torch

from nebula_engine.config import SchedulerConfig
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.scheduler import Scheduler
from nebula_engine.engine.sequence import Sequence
from nebula_engine.kvcache.pool import (KVCacheManager, KVCacheStorage, OutOfPagesError,
                                        OutOfStateSlotsError, PagePool, num_pages_for_budget)
from nebula_engine.kvcache.spec import (FullAttentionSpec, KVCacheGroupSpec, LinearStateSpec, MLALatentSpec,
                                        bytes_per_page, bytes_per_state_slot)

LINEAR = LinearStateSpec(conv_channels=12, conv_width=3, num_heads=2, head_k_dim=4, head_v_dim=5,
                         dtype=torch.bfloat16)
HYBRID = [KVCacheGroupSpec((0,), FullAttentionSpec(2, 8, 8)), KVCacheGroupSpec((0, 1, 2), LINEAR)]


def test_slot_is_taken_with_the_first_pages_and_kept_while_growing():
    kv = KVCacheManager(PagePool(8), page_size=4, num_state_slots=2)
    kv.allocate_slots("a", 3)
    kv.allocate_slots("b", 1)
    assert (kv.state_slot("a"), kv.state_slot("b")) == (0, 1)
    kv.allocate_slots("a", 9)
    assert kv.state_slot("a") == 0 and kv.state_slots.num_free == 0
    kv.free("a")
    assert kv.state_slots.num_free == 1
    kv.allocate_slots("c", 2)
    assert kv.state_slot("c") == 0


def test_out_of_slots_refuses_admission_and_changes_nothing():
    kv = KVCacheManager(PagePool(8), page_size=4, num_state_slots=1)
    kv.allocate_slots("a", 4)
    assert not kv.can_allocate("b", 1) and kv.can_allocate("a", 8)
    with pytest.raises(OutOfStateSlotsError, match="all 1 linear-attention state slots are in use"):
        kv.allocate_slots("b", 1)
    assert kv.num_free_pages == 7 and "b" not in kv.block_tables and "b" not in kv.state_slots.slot_of


def test_out_of_pages_takes_no_slot():
    kv = KVCacheManager(PagePool(2), page_size=4, num_state_slots=2)
    with pytest.raises(OutOfPagesError):
        kv.allocate_slots("a", 9)
    assert kv.state_slots.num_free == 2 and not kv.state_slots.slot_of


def test_models_without_linear_layers_have_no_slots():
    assert KVCacheManager(PagePool(4), page_size=4).state_slot("any") is None


@pytest.mark.parametrize("seed", range(4))
def test_random_alloc_free_never_leaks_or_shares_slots(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(PagePool(24), page_size=4, num_state_slots=3)
    lengths: dict[str, int] = {}
    for step in range(300):
        if rng.random() < 0.6:
            seq = rng.choice(list(lengths) + [f"s{step}"])
            target = lengths.get(seq, 0) + rng.randint(1, 9)
            try:
                kv.allocate_slots(seq, target)
                lengths[seq] = target
            except (OutOfPagesError, OutOfStateSlotsError):
                assert not kv.can_allocate(seq, target)
        elif lengths:
            seq = rng.choice(list(lengths))
            kv.free(seq)
            del lengths[seq]
        held = kv.state_slots.slot_of
        assert set(held) == set(lengths) == set(kv.block_tables)
        assert len(set(held.values())) == len(held) and len(held) + kv.state_slots.num_free == 3
    for seq in list(lengths):
        kv.free(seq)
    assert kv.state_slots.num_free == 3 and kv.num_free_pages == 24


def _seq(seq_id, prompt_len):
    return Sequence(seq_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=2, temperature=0))


def test_scheduler_admits_by_free_slots_and_preemption_returns_them():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                          KVCacheManager(PagePool(4), page_size=4, num_state_slots=2))
    for name, length in (("a", 5), ("b", 3), ("c", 2)):
        scheduler.add(_seq(name, length))
    out = scheduler.schedule()  # pages suffice for all three; slots only for two
    assert [(e.seq_id, e.state_slot) for e in out.scheduled] == [("a", 0), ("b", 1)]
    scheduler.advance(out)
    a = scheduler.running[0]
    for _ in range(8):  # a: 13 tokens need 4 pages; 1 is free, b holds 1 => b, the newest, is preempted
        a.append_token(7, 0.0)
    out = scheduler.schedule()
    assert out.preempted_seq_ids == ("b",)
    assert [(e.seq_id, e.state_slot) for e in out.scheduled] == [("a", 0)]
    assert scheduler.kv_cache.state_slots.slot_of == {"a": 0} and scheduler.waiting[0].seq_id == "b"


def test_storage_and_budget_account_for_state_slots():
    storage = KVCacheStorage(HYBRID, num_pages=3, page_size=4, device="cpu", num_state_slots=5)
    assert len(storage.layer_caches) == 1 and len(storage.linear_states) == 3
    conv, recurrent = storage.linear_states[2]
    assert conv.shape == (5, 12, 3) and conv.dtype == torch.bfloat16
    assert recurrent.shape == (5, 2, 4, 5) and recurrent.dtype == torch.float32
    assert bytes_per_state_slot(HYBRID) == 3 * (12 * 3 * 2 + 2 * 4 * 5 * 4)
    assert bytes_per_page(HYBRID, 4) == 4 * 2 * 16 * 4  # state groups hold no pages
    page, slot = bytes_per_page(HYBRID, 4), bytes_per_state_slot(HYBRID)
    assert num_pages_for_budget(HYBRID, 4, 10 * page + 5 * slot, num_state_slots=5) == 10


def test_latent_spec_page_bytes():
    spec = MLALatentSpec(kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    assert spec.page_bytes(16) == 16 * 576 * 2
    [cache] = spec.allocate(3, 16, "cpu")
    assert cache.shape == (3, 16, 576) and cache.dtype == torch.bfloat16

import pytest

from builders import request
from nebula_engine.cluster.control.cache_manager import CacheManager
from nebula_engine.cluster.control.config import CacheManagerConfig
from nebula_engine.cluster.control.messages import CacheKind, Tier
from nebula_engine.cluster.control.request_keys import RequestKeys

PC, PIC = CacheKind.PC, CacheKind.PIC
DEVICE, HOST = Tier.DEVICE, Tier.HOST


def keys_of(*segments):
    return RequestKeys.of(request("r", *segments))


def make_ghost(manager: CacheManager, kind: CacheKind, key: str, tier: Tier = DEVICE) -> None:
    manager.on_presence(kind, key, tier, True, 1)
    manager.on_presence(kind, key, tier, False, 1)


def test_initial_share_is_one_half():
    assert CacheManager().pc_share == 0.5


def test_presence_moves_ids_between_live_and_ghost_queues():
    manager = CacheManager()
    device = manager.tiers[DEVICE]
    manager.on_presence(PIC, "doc", DEVICE, True, 10)
    assert "doc" in device.live[PIC] and "doc" not in device.ghosts[PIC]
    manager.on_presence(PIC, "doc", DEVICE, False, 10)
    assert "doc" not in device.live[PIC] and "doc" in device.ghosts[PIC]
    manager.on_presence(PIC, "doc", DEVICE, True, 10)
    assert "doc" in device.live[PIC] and "doc" not in device.ghosts[PIC]


def test_prefix_first_each_token_counted_once():
    keys = keys_of(("P", "sys", 100), ("I", "doc", 40), ("I", "other", 7), ("R", "q", 3))
    manager = CacheManager()
    manager.on_presence(PC, keys.pc_keys[0], DEVICE, True, 100)  # live prefix
    make_ghost(manager, PC, keys.pc_keys[1])  # evicted continuation of the prefix
    make_ghost(manager, PIC, "doc")  # the same content is also a PIC ghost: PC wins
    make_ghost(manager, PIC, "other")
    assert manager.attribute(keys) == {"pc_live": 100, "pc_ghost": 40, "pic_live": 0, "pic_ghost": 7}


def test_live_pic_hit_is_not_a_ghost():
    keys = keys_of(("P", "sys", 100), ("I", "doc", 40))
    manager = CacheManager()
    manager.on_presence(PIC, "doc", DEVICE, True, 40)
    assert manager.attribute(keys)["pic_live"] == 40


def test_ghost_prefix_after_a_miss_is_not_counted():
    keys = keys_of(("P", "sys", 100), ("I", "doc", 40))
    manager = CacheManager()
    make_ghost(manager, PC, keys.pc_keys[1])  # chain entry without its parent: no prefix match
    assert manager.attribute(keys) == {"pc_live": 0, "pc_ghost": 0, "pic_live": 0, "pic_ghost": 0}


def test_counts_tokens_not_segments():
    keys = keys_of(("I", "a", 5), ("I", "b", 300))
    manager = CacheManager()
    make_ghost(manager, PIC, "a")
    make_ghost(manager, PIC, "b")
    assert manager.attribute(keys)["pic_ghost"] == 305


def test_share_updates_every_window_by_at_most_one_step():
    manager = CacheManager(CacheManagerConfig(update_window=4))
    keys = keys_of(("I", "doc", 10))
    make_ghost(manager, PIC, "doc")
    results = [manager.observe(keys) for _ in range(8)]
    assert results[:3] == [None] * 3 and results[4:7] == [None] * 3
    assert results[3][DEVICE] == pytest.approx(0.49) and results[7][DEVICE] == pytest.approx(0.48)


def test_step_is_scaled_by_ghost_balance():
    manager = CacheManager(CacheManagerConfig(update_window=1))
    keys = keys_of(("P", "sys", 30), ("I", "doc", 10))
    make_ghost(manager, PC, keys.pc_keys[0])
    make_ghost(manager, PIC, "doc")
    assert manager.observe(keys)[DEVICE] == pytest.approx(0.5 + 0.01 * (30 - 10) / 40)


def test_no_ghosts_no_change():
    manager = CacheManager(CacheManagerConfig(update_window=1))
    assert manager.observe(keys_of(("I", "doc", 10))) == {tier: 0.5 for tier in Tier}


def test_share_clipped_to_unit_interval():
    manager = CacheManager(CacheManagerConfig(update_window=1, initial_pc_share=0.005))
    keys = keys_of(("I", "doc", 10))
    make_ghost(manager, PIC, "doc")
    assert manager.observe(keys)[DEVICE] == 0.0
    assert manager.observe(keys)[DEVICE] == 0.0
    up = CacheManager(CacheManagerConfig(update_window=1, initial_pc_share=0.995))
    pc_keys = keys_of(("P", "sys", 10))
    make_ghost(up, PC, pc_keys.pc_keys[0])
    assert up.observe(pc_keys)[DEVICE] == 1.0


def test_window_counters_restart_after_update():
    manager = CacheManager(CacheManagerConfig(update_window=2))
    pic = keys_of(("I", "doc", 10))
    make_ghost(manager, PIC, "doc")
    manager.observe(pic)
    manager.observe(pic)
    assert manager.tiers[DEVICE].ghost_tokens == {PC: 0, PIC: 0}
    assert manager.history == [0.5, pytest.approx(0.49)]


def test_each_tier_tunes_its_share_from_its_own_ghosts():
    """§6.2: the four queues per storage tier. A demotion makes a device ghost and a host entry."""
    manager = CacheManager(CacheManagerConfig(update_window=1))
    keys = keys_of(("P", "sys", 30), ("I", "doc", 10))
    manager.on_presence(PC, keys.pc_keys[0], DEVICE, True, 30)
    manager.on_presence(PC, keys.pc_keys[0], DEVICE, False, 30)  # demoted: a device ghost ...
    manager.on_presence(PC, keys.pc_keys[0], HOST, True, 30)  # ... and live on the host
    make_ghost(manager, PIC, "doc", HOST)  # dropped from the host
    shares = manager.observe(keys)
    assert shares[DEVICE] == pytest.approx(0.51)  # device: only PC ghosts
    assert shares[HOST] == pytest.approx(0.49)  # host: the prefix is live, the PIC segment a ghost
    assert manager.attribute(keys, HOST) == {"pc_live": 30, "pc_ghost": 0, "pic_live": 0, "pic_ghost": 10}

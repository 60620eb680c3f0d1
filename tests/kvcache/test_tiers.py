"""Host and disk tiers: demotion cascade, promotion, persistence across a restart, damage detection."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nebula_engine.kvcache.disk_tier import INDEX_FILE, DiskTier
from nebula_engine.kvcache.events import CacheIndex, CacheKind, EventLog, MoveEvent, StoreEvent, Tier
from nebula_engine.kvcache.tiers import TierChain, TierConfig

PAYLOAD = {"pages": [torch.arange(24, dtype=torch.float32).view(2, 3, 4) / 7, torch.tensor([[1, 2], [3, 4]])]}

READ_BACK = """
import sys, torch
from nebula_engine.kvcache.disk_tier import DiskTier
payload = DiskTier(sys.argv[1], 100).get("pc", "k1")
sys.stdout.write("".join(t.numpy().tobytes().hex() + "\\n" for t in payload["pages"]))
"""


def hex_lines(payload) -> list[str]:
    return [t.numpy().tobytes().hex() for t in payload["pages"]]


def written_tier(path: Path) -> DiskTier:
    disk = DiskTier(path, capacity_tokens=100)
    disk.put("pc", "k1", 4, PAYLOAD)
    disk.close()  # waits for the background write
    return disk


def test_disk_entry_survives_a_process_restart_byte_identical(tmp_path):
    written_tier(tmp_path)
    result = subprocess.run([sys.executable, "-c", READ_BACK, str(tmp_path)], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.split() == hex_lines(PAYLOAD)


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete"])
def test_damaged_file_is_reported_once_and_is_a_miss(tmp_path, caplog, damage):
    written_tier(tmp_path)
    [data_file] = [p for p in tmp_path.iterdir() if p.suffix == ".kv"]
    data = bytearray(data_file.read_bytes())
    if damage == "flip_byte":
        data[len(data) // 2] ^= 0xFF
        data_file.write_bytes(bytes(data))
    elif damage == "truncate":
        data_file.write_bytes(bytes(data[:-5]))
    else:
        data_file.unlink()
    disk = DiskTier(tmp_path, capacity_tokens=100)
    with caplog.at_level(logging.WARNING):
        assert disk.get("pc", "k1") is None
        assert disk.get("pc", "k1") is None  # dropped: a plain miss, not reported again
    disk.close()
    assert disk.num_corrupt == 1 and len(caplog.records) == 1
    assert json.loads((tmp_path / INDEX_FILE).read_text())["entries"] == []


def test_unreadable_index_starts_empty_and_says_so(tmp_path, caplog):
    (tmp_path / INDEX_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        disk = DiskTier(tmp_path, capacity_tokens=10)
    assert disk.entries() == [] and disk.num_corrupt == 1 and "unreadable" in caplog.text
    disk.close()


def test_demotion_cascades_host_to_disk_to_drop_and_promotion_returns_the_payload(tmp_path):
    events = EventLog(worker=0)
    index = CacheIndex(0)
    chain = TierChain(TierConfig(host_capacity_tokens=4, disk_capacity_tokens=4, disk_path=str(tmp_path)), events)
    for key in ("a", "b", "c"):
        events.store(CacheKind.PC, (key,), 4)  # the device held it first
        assert chain.demote(CacheKind.PC, key, 4, {"pages": [torch.full((1,), float(ord(key)))]})
    # a: device -> host -> disk -> dropped; b: host -> disk; c: on host
    assert (chain.tier_of(CacheKind.PC, "a"), chain.tier_of(CacheKind.PC, "b"), chain.tier_of(CacheKind.PC, "c")) \
        == (None, Tier.DISK, Tier.HOST)
    assert chain.promote(CacheKind.PC, "b")["pages"][0].item() == ord("b")
    assert chain.promote(CacheKind.PC, "c")["pages"][0].item() == ord("c")
    assert chain.promote(CacheKind.PC, "a") is None
    assert chain.promoted_tokens == {(CacheKind.PC, Tier.DISK): 4, (CacheKind.PC, Tier.HOST): 4}  # misses count none
    drained = events.drain_events()
    assert [(e.src, e.dst) for e in drained if isinstance(e, MoveEvent)][-2:] == [(Tier.DISK, Tier.DEVICE),
                                                                                  (Tier.HOST, Tier.DEVICE)]
    for event in drained:
        index.apply(event)
    assert set(index.entries) == {(CacheKind.PC, "b"), (CacheKind.PC, "c")}  # both back on the device
    assert all(e.tier is Tier.DEVICE for e in index.entries.values())
    chain.close()


def test_without_demotion_eviction_drops_and_a_restart_announces_persisted_entries(tmp_path):
    chain = TierChain(TierConfig(host_capacity_tokens=8, demote_on_evict=False), EventLog(0))
    assert not chain.demote(CacheKind.PIC, "x", 2, {}) and chain.entries() == []
    config = TierConfig(disk_capacity_tokens=8, disk_path=str(tmp_path))
    first = TierChain(config, EventLog(0))
    first.demote(CacheKind.PIC, "seg", 3, {"pages": [torch.ones(2)], "state": {"end": torch.zeros(1)}})
    first.close()
    events = EventLog(worker=0)
    restarted = TierChain(config, events)
    assert events.drain_events() == [StoreEvent(0, 1, CacheKind.PIC, ("seg",), 3, Tier.DISK)]
    assert restarted.promote(CacheKind.PIC, "seg")["state"]["end"].tolist() == [0.0]
    restarted.close()

"""A crafted ``index.json`` cannot make the disk tier read or delete a file outside its directory."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from nebula_engine.kvcache.disk_tier import INDEX_FILE, DiskTier, data_file_name
from nebula_engine.kvcache.events import CacheKind, EventLog
from nebula_engine.kvcache.tiers import TierChain, TierConfig

PAYLOAD = {"pages": [torch.arange(6, dtype=torch.float32)]}


def record(kind: str, key: str, file: str, **fields) -> dict:
    return {"kind": kind, "key": key, "num_tokens": 4, "file": file, "nbytes": 10, "sha256": "0" * 64, **fields}


@pytest.fixture()
def victims(tmp_path):
    """Files outside the tier directory, and a tier directory holding one honest entry."""
    outside = tmp_path / "outside"
    outside.mkdir()
    secrets = {name: outside / name for name in ("secret.kv", "pc-k2.kv", "data.bin")}
    for path in secrets.values():
        path.write_bytes(b"do not touch")
    tier_dir = tmp_path / "tier"
    honest = DiskTier(tier_dir, capacity_tokens=100)
    honest.put("pc", "good", 4, PAYLOAD)
    honest.close()
    return tier_dir, secrets


def craft_index(tier_dir, secrets) -> list[dict]:
    (tier_dir / "pc-k2.kv").symlink_to(secrets["pc-k2.kv"])  # its own name, but a link out of the directory
    crafted = [
        record("pc", "k0", "../outside/secret.kv"),
        record("pc", "k1", str(secrets["data.bin"])),  # absolute
        record("pc", "k2", "pc-k2.kv"),
        record("pc", "k3", "sub/../../outside/secret.kv"),
        record("pc", "../k4", "pc-../k4.kv"),  # a key that would make its own name a path
        record("other", "k5", "other-k5.kv"),  # a kind the tier never writes
        record("pc", "k6", "pc-k6.kv", num_tokens="many"),
        ["not", "a", "record"],
    ]
    index = json.loads((tier_dir / INDEX_FILE).read_text())
    index["entries"] += crafted
    (tier_dir / INDEX_FILE).write_text(json.dumps(index))
    return crafted


def test_crafted_index_entries_are_corrupt_misses_never_read_or_deleted(victims, caplog):
    tier_dir, secrets = victims
    crafted = craft_index(tier_dir, secrets)
    with caplog.at_level(logging.WARNING):
        disk = DiskTier(tier_dir, capacity_tokens=100)
    assert disk.num_corrupt == len(crafted) and len(caplog.records) == 1  # one line for all of them
    assert "neither read nor deleted" in caplog.text
    assert [(e.kind, e.key) for e in disk.entries()] == [("pc", "good")]
    for key in ("k0", "k1", "k2", "k3", "../k4"):
        assert ("pc", key) not in disk and disk.get("pc", key) is None and disk.prefetch("pc", key) is None
        disk.remove("pc", key)
    assert disk.get("pc", "good")["pages"][0].tolist() == PAYLOAD["pages"][0].tolist()
    disk.put("pc", "new", 97, PAYLOAD)  # with "good" (4 tokens) over capacity: the oldest is evicted
    while disk.used_tokens > disk.capacity_tokens:
        oldest = disk.entries()[0]
        disk.remove(oldest.kind, oldest.key)
    disk.close()
    assert all(path.read_bytes() == b"do not touch" for path in secrets.values())
    assert (tier_dir / "pc-k2.kv").is_symlink()  # not even the link was followed or removed
    assert [r["key"] for r in json.loads((tier_dir / INDEX_FILE).read_text())["entries"]] == ["new"]


def test_a_restarted_tier_chain_announces_only_confined_entries(victims):
    tier_dir, secrets = victims
    craft_index(tier_dir, secrets)
    events = EventLog(worker=0)
    chain = TierChain(TierConfig(disk_capacity_tokens=100, disk_path=str(tier_dir)), events)
    assert [(e.kind, e.keys) for e in events.drain_events()] == [(CacheKind.PC, ("good",))]
    chain.close()


def test_a_data_file_swapped_for_a_symlink_after_loading_is_not_followed(victims, caplog):
    tier_dir, secrets = victims
    disk = DiskTier(tier_dir, capacity_tokens=100)
    data_file = tier_dir / data_file_name("pc", "good")
    data_file.unlink()
    data_file.symlink_to(secrets["secret.kv"])
    with caplog.at_level(logging.WARNING):
        assert disk.get("pc", "good") is None
    disk.close()
    assert "unreadable" in caplog.text and secrets["secret.kv"].read_bytes() == b"do not touch"


@pytest.mark.parametrize("kind, key", [("pc", "../x"), ("pc", "a/b"), ("pc", ""), ("../pc", "k"), ("pc", "k\x00")])
def test_keys_that_would_name_another_path_are_refused_when_written(tmp_path, kind, key):
    disk = DiskTier(tmp_path, capacity_tokens=100)
    with pytest.raises(ValueError, match="cannot name a file"):
        disk.put(kind, key, 1, PAYLOAD)
    disk.close()

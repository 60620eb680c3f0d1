"""The disk tier trusts nothing it reads back: a poisoned, tampered or swapped entry, one that does not decode, and
an index reached through a symlink are misses (reported once, dropped), and a request that needed them is served
by recomputation with the same answer as an engine that never had a disk tier."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle

import pytest
import torch

from nebula_engine import LLM, SamplingParams
from nebula_engine.engine.offline_prefill import OfflinePrefill, build_prefill_engine
from nebula_engine.kvcache.disk_tier import INDEX_FILE, DiskTier, serialize
from nebula_engine.kvcache.store_key import KEY_FILE, StoreKeyError, derive_key, entry_mac, store_key
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)

PAYLOAD = {"pages": [torch.arange(24, dtype=torch.float32).view(2, 3, 4)]}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(page_size=4, num_pages=128)
DOCUMENT = "Owls hunt at night and can turn their heads almost all the way around."
PROMPT = f"Use this note.\n<pic>{DOCUMENT}</pic>\nQuestion: owls?"


class Payload:
    """Unpickling this runs ``os.system``: what a loader that trusts the file would execute."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def index_of(root) -> dict:
    return json.loads((root / INDEX_FILE).read_text())


def rewrite_entry(root, data: bytes, mac: str | None = None) -> None:
    """Replace the only entry's file with ``data`` and make the index agree on its size, with ``mac`` or (what
    anyone who can write the directory could do without the key) a plain SHA-256."""
    index = index_of(root)
    [record] = index["entries"]
    (root / record["file"]).write_bytes(data)
    record["nbytes"], record["mac"] = len(data), mac or hashlib.sha256(data).hexdigest()
    (root / INDEX_FILE).write_text(json.dumps(index))


def written(root) -> None:
    disk = DiskTier(root, capacity_tokens=100)
    disk.put("pc", "k1", 4, PAYLOAD)
    disk.close()


def test_a_pickle_planted_with_its_size_and_checksum_is_a_reported_miss_and_never_runs(tmp_path, caplog):
    written(tmp_path)
    marker = tmp_path / "pwned"
    rewrite_entry(tmp_path, pickle.dumps(Payload(marker)))
    disk = DiskTier(tmp_path, capacity_tokens=100)
    with caplog.at_level(logging.WARNING):
        assert [disk.get("pc", "k1") for _ in range(3)] == [None, None, None]
    disk.close()
    assert not marker.exists() and disk.num_corrupt == 1 and len(caplog.records) == 1
    assert "MAC mismatch" in caplog.text and index_of(tmp_path)["entries"] == []  # dropped, not retried


def test_an_authenticated_file_that_does_not_decode_is_a_reported_miss_and_dropped(tmp_path, caplog):
    written(tmp_path)
    marker = tmp_path / "pwned"
    for data in (pickle.dumps(Payload(marker)), serialize(["not", "a", "payload"])):
        rewrite_entry(tmp_path, data, entry_mac(store_key(tmp_path), "pc", "k1", 4, 0, data))
        disk = DiskTier(tmp_path, capacity_tokens=100)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert disk.prefetch("pc", "k1").result() is None  # the background read does not raise either
            assert disk.get("pc", "k1") is None and disk.get("pc", "k1") is None
        disk.close()
        assert disk.num_corrupt == 1 and len(caplog.records) == 1 and not marker.exists()
        assert index_of(tmp_path)["entries"] == []
        written(tmp_path)


def test_zeroed_kv_with_a_recomputed_checksum_is_a_miss(tmp_path):
    written(tmp_path)
    buffer = io.BytesIO()
    torch.save({"pages": [torch.zeros(2, 3, 4)]}, buffer)
    rewrite_entry(tmp_path, buffer.getvalue())
    disk = DiskTier(tmp_path, capacity_tokens=100)
    assert disk.get("pc", "k1") is None and disk.num_corrupt == 1
    disk.close()


def test_an_honest_file_replayed_under_another_key_is_a_miss(tmp_path):
    disk = DiskTier(tmp_path, capacity_tokens=100)
    disk.put("pc", "k1", 4, PAYLOAD)
    disk.put("pc", "k2", 4, {"pages": [torch.ones(2, 3, 4)]})
    disk.close()
    index = index_of(tmp_path)
    first, second = index["entries"]
    (tmp_path / second["file"]).write_bytes((tmp_path / first["file"]).read_bytes())
    second["nbytes"], second["mac"] = first["nbytes"], first["mac"]  # k1's bytes and MAC, filed as k2
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    disk = DiskTier(tmp_path, capacity_tokens=100)
    assert disk.get("pc", "k2") is None
    assert disk.get("pc", "k1")["pages"][0].tolist() == PAYLOAD["pages"][0].tolist()
    disk.close()


def test_entries_of_another_store_key_are_misses(tmp_path):
    disk = DiskTier(tmp_path, capacity_tokens=100, key=derive_key("cluster secret A, long enough"))
    disk.put("pc", "k1", 4, PAYLOAD)
    disk.close()
    other = DiskTier(tmp_path, capacity_tokens=100, key=derive_key("cluster secret B, long enough"))
    assert other.get("pc", "k1") is None and other.num_corrupt == 1
    other.close()


@pytest.mark.parametrize("target", ["outside", "system"])
def test_an_index_that_is_a_symlink_is_never_read(tmp_path, caplog, target):
    store = tmp_path / "store"
    outside = tmp_path / "outside"
    written(outside)  # a complete, honest-looking index elsewhere
    store.mkdir()
    link_target = outside / INDEX_FILE if target == "outside" else "/etc/hostname"
    (store / INDEX_FILE).symlink_to(link_target)
    before = (outside / INDEX_FILE).read_bytes()
    with caplog.at_level(logging.WARNING):
        disk = DiskTier(store, capacity_tokens=100)
    assert disk.entries() == [] and disk.num_corrupt == 1 and "regular file" in caplog.text
    disk.put("pc", "k9", 4, PAYLOAD)
    disk.close()
    assert not (store / INDEX_FILE).is_symlink()  # replaced by the store's own index, the target untouched
    assert (outside / INDEX_FILE).read_bytes() == before
    assert [e["key"] for e in index_of(store)["entries"]] == ["k9"]


def test_an_index_without_macs_is_ignored_whole(tmp_path, caplog):
    written(tmp_path)
    index = index_of(tmp_path)
    index["version"] = 1
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING):
        disk = DiskTier(tmp_path, capacity_tokens=100)
    assert disk.entries() == [] and "carry no MAC" in caplog.text
    disk.close()


def test_the_key_file_is_private_and_refused_when_it_is_not(tmp_path):
    key = store_key(tmp_path)
    path = tmp_path / KEY_FILE
    assert len(key) == 32 and (path.stat().st_mode & 0o777) == 0o600 and store_key(tmp_path) == key
    path.chmod(0o644)
    with pytest.raises(StoreKeyError, match="readable or writable by others"):
        store_key(tmp_path)
    path.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("00" * 32)
    elsewhere.chmod(0o600)
    path.symlink_to(elsewhere)
    with pytest.raises(StoreKeyError, match="symlink"):
        store_key(tmp_path)


# ---- through an engine: a damaged entry costs a recomputation, never a failed request ----

@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"]))


@pytest.fixture(scope="module")
def cold_tokens(model):
    return LLM(model, pic_backend="epic", **ENGINE).generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def prefilled_store(model, root):
    corpus = root.parent / "docs.jsonl"
    corpus.write_text(json.dumps({"text": DOCUMENT}) + "\n")
    runner = OfflinePrefill(build_prefill_engine(model, root, "epic", **ENGINE))
    try:
        assert runner.run(str(corpus)).prefilled == 1
    finally:
        runner.close()


def pic_entry(root) -> dict:
    [record] = [r for r in index_of(root)["entries"] if r["kind"] == "pic"]
    return record


def tamper(root, how: str) -> None:
    record = pic_entry(root)
    path = root / record["file"]
    if how == "pickle":
        data = pickle.dumps(Payload(root / "pwned"))
    else:  # the document's KV zeroed, re-saved in the tier's own format
        payload = torch.load(io.BytesIO(path.read_bytes()), weights_only=True)
        payload["pages"] = [torch.zeros_like(t) for t in payload["pages"]]
        data = serialize(payload)
    path.write_bytes(data)
    index = index_of(root)
    for entry in index["entries"]:
        if entry["file"] == record["file"]:
            entry["nbytes"], entry["mac"] = len(data), hashlib.sha256(data).hexdigest()
    (root / INDEX_FILE).write_text(json.dumps(index))


@pytest.mark.parametrize("how", ["pickle", "zeroed"])
def test_a_tampered_segment_is_recomputed_and_the_answer_is_right_every_time(model, cold_tokens, tmp_path, how):
    root = tmp_path / "disk"
    prefilled_store(model, root)
    key = pic_entry(root)["key"]
    tamper(root, how)
    served = LLM(model, pic_backend="epic", disk_cache_tokens=100_000, disk_cache_path=str(root), **ENGINE)
    outputs = [served.generate(PROMPT, GREEDY)[0] for _ in range(3)]
    disk = served.llm_engine.cache_store.tiers.disk
    served.llm_engine.cache_store.close()
    assert [o.outputs[0].token_ids for o in outputs] == [cold_tokens] * 3
    assert served.llm_engine.model_runner.pic_executor.stats.segment_misses == 1  # recomputed once, then cached
    assert disk.num_corrupt == 1 and ("pic", key) not in disk
    assert not (root / "pwned").exists()


def test_an_untampered_segment_is_still_served_from_disk(model, cold_tokens, tmp_path):
    root = tmp_path / "disk"
    prefilled_store(model, root)
    served = LLM(model, pic_backend="epic", disk_cache_tokens=100_000, disk_cache_path=str(root), **ENGINE)
    output = served.generate(PROMPT, GREEDY)[0]
    served.llm_engine.cache_store.close()
    stats = served.llm_engine.model_runner.pic_executor.stats
    assert output.outputs[0].token_ids == cold_tokens and (stats.segment_misses, stats.segment_hits) == (0, 1)


"""Loader: sharded checkpoints, and a clear error naming the culprit for every broken checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nebula_engine.model.loader import load_model
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)


@pytest.fixture
def checkpoint(checkpoint_factory, tmp_path):
    """A private, mutable copy of the tiny Mistral checkpoint."""
    return shutil.copytree(checkpoint_factory(CASES_BY_NAME["mistral_gqa2"]), tmp_path / "ckpt")


def _rewrite(checkpoint, edit) -> None:
    tensors = load_file(checkpoint / "model.safetensors")
    edit(tensors)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})


def test_sharded_checkpoint_loads_same_weights(checkpoint, tmp_path):
    reference, _, _ = load_model(str(checkpoint))
    tensors = load_file(checkpoint / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, checkpoint / shard, metadata={"format": "pt"})
    (checkpoint / "model.safetensors").unlink()
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    sharded, _, _ = load_model(str(checkpoint))
    for (name, a), (_, b) in zip(reference.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


def test_missing_shard_is_named(checkpoint):
    weight_map = {n: "model-00002-of-00002.safetensors" for n in load_file(checkpoint / "model.safetensors")}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(str(checkpoint))


def test_corrupt_file_is_named(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ValueError, match=r"corrupt or truncated safetensors file .*model\.safetensors"):
        load_model(str(checkpoint))


def test_truncated_file_is_named(checkpoint):
    path = checkpoint / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"corrupt or truncated safetensors file .*model\.safetensors"):
        load_model(str(checkpoint))


def test_missing_tensor_is_named(checkpoint):
    _rewrite(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(checkpoint))


def test_shape_mismatch_is_named(checkpoint):
    _rewrite(checkpoint, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(48, 64)}))
    expected = r"shape mismatch .*model\.layers\.0\.self_attn\.k_proj\.weight.*\(48, 64\).*\(32, 64\)"
    with pytest.raises(ValueError, match=expected):
        load_model(str(checkpoint))


def test_unexpected_tensor_is_named(checkpoint):
    _rewrite(checkpoint, lambda t: t.update({"model.layers.0.self_attn.bogus.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.bogus\.weight has no matching"):
        load_model(str(checkpoint))


def test_missing_lm_head_of_untied_model_is_named(checkpoint):
    _rewrite(checkpoint, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\): lm_head\.weight"):
        load_model(str(checkpoint))


def test_unknown_model_type_lists_supported(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match=r"'gpt_neox'.*supported: .*mistral"):
        load_model(str(checkpoint))


def test_missing_config_and_missing_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(checkpoint))
    (checkpoint / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(checkpoint))


def test_uncached_hub_id_offline_is_clear(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(FileNotFoundError, match=r"'nebula-test/not-a-model'.*HF_HUB_OFFLINE"):
        load_model("nebula-test/not-a-model")

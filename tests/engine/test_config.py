import pytest

from nebula_engine.config import CacheConfig, EngineConfig, SchedulerConfig


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

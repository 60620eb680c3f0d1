import json
from dataclasses import asdict

import pytest

from nebula_engine.cluster.control.config import ClusterProfile, PrefillTimeModel


def test_shipped_profiles_load_and_document_their_numbers():
    for name in ("default", "deepseek-v2-lite", "qwen3.5-35b-a3b", "qwen3-30b-a3b"):
        profile = ClusterProfile.load(name)
        assert profile.kv_bytes_per_token > 0 and profile.cache_capacity_tokens > 0
        assert {"kv_bytes_per_token", "prefill.per_token_s", "cache_capacity_tokens"} <= set(profile.sources)
    assert ClusterProfile.load().kv_bytes_per_token == 128 * 1024  # Mistral-7B bf16


def test_profile_round_trips_through_a_json_file(tmp_path):
    profile = ClusterProfile.load()
    data = asdict(profile)
    data["prefill"]["per_token_s"] = 1e-4  # a calibrated number
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(data))
    loaded = ClusterProfile.load(path)
    assert loaded.prefill.per_token_s == 1e-4 and loaded.inter_node == profile.inter_node


def test_unknown_profile_is_an_error():
    with pytest.raises(FileNotFoundError):
        ClusterProfile.load("no-such-profile")


def test_prefill_model_has_linear_and_attention_terms():
    model = PrefillTimeModel(fixed_s=0.01, per_token_s=1e-4, attention_s=1e-8)
    assert model.seconds(0) == 0.0
    assert model.seconds(1000) == pytest.approx(0.01 + 0.1 + 1e-8 * 1000 * 500)
    assert model.seconds(1000, context_tokens=2000) > model.seconds(1000)


def test_links_follow_nodes():
    profile = ClusterProfile.load()
    assert profile.link(0, 0) is None and profile.transfer_seconds(2, 2, 10_000) == 0.0
    assert profile.link(0, 3) == profile.intra_node and profile.link(3, 4) == profile.inter_node
    assert profile.transfer_seconds(0, 4, 1000) == pytest.approx(
        profile.inter_node.latency_s + 1000 * profile.kv_bytes_per_token / profile.inter_node.bandwidth_bytes_per_s)

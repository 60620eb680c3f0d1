import json

import pytest
from click.testing import CliRunner

from nebula_engine.cli.simulate import simulate
from nebula_engine.workloads.registry import BUNDLED_DIR


def run(*args):
    return CliRunner().invoke(simulate, list(args))


def test_json_report_on_bundled_ragpulse_slice():
    result = run("--data", str(BUNDLED_DIR), "--limit", "60", "--qps", "20", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["workload"] == "ragpulse" and report["num_requests"] == 60
    assert 0 < report["cache_hit_ratio"] <= report["hit_ratio_bound"] < 1
    assert 0 < report["ttft_p50_s"] <= report["ttft_p95_s"] <= report["ttft_p99_s"]
    assert report["cache"] == "self-tuning" and report["load"] == pytest.approx(20 / report["pc_capacity_rps"])


def test_load_sets_the_rate_against_the_prefix_caching_capacity():
    result = run("--data", str(BUNDLED_DIR), "--limit", "40", "--load", "0.5", "--policy", "pc", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["load"] == pytest.approx(0.5) and report["qps"] == pytest.approx(0.5 * report["pc_capacity_rps"])
    assert report["cache"] == "unified-lru"  # a baseline keeps SGLang's plain LRU
    assert run("--qps", "2", "--load", "1").exit_code == 2


def test_a_measured_profile_file_is_read(tmp_path):
    from dataclasses import replace

    from nebula_engine.cluster.control.config import ClusterProfile

    profile = replace(ClusterProfile.load(), name="measured-here", shared_compute=True)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile.to_dict()))
    result = run("--data", str(BUNDLED_DIR), "--limit", "20", "--profile", str(path), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["profile"] == "measured-here"


def test_a_local_clusters_profile_is_refused_with_the_reason(tmp_path):
    """A profile that says a waiting home prefills the lead apart (a local cluster's engines) plans leads the
    simulator does not model: a CLI error, and ValueError from the simulator itself."""
    from dataclasses import replace

    from nebula_engine.cluster.control.config import ClusterConfig, ClusterProfile
    from nebula_engine.cluster.sim.simulator import SimulationConfig, Simulator

    profile = replace(ClusterProfile.load(), name="local-cpu", lead_while_waiting=True)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile.to_dict()))
    result = run("--data", str(BUNDLED_DIR), "--limit", "20", "--profile", str(path))
    assert result.exit_code == 2 and "--profile" in result.output and "lead_while_waiting" in result.output
    with pytest.raises(ValueError, match="lead_while_waiting"):
        Simulator(SimulationConfig(cluster=ClusterConfig(num_prefill_workers=2, profile=profile)), [])


def test_text_report_names_the_settings():
    result = run("--data", str(BUNDLED_DIR), "--limit", "30", "--policy", "pc")
    assert result.exit_code == 0, result.output
    assert "policy=pc view=event" in result.output and "TTFT" in result.output


def test_bad_values_are_click_errors():
    for args, option in ((["--policy", "magic"], "--policy"), (["--qps", "0"], "--qps"),
                         (["--workers", "0"], "--workers"), (["--view", "psychic"], "--view"),
                         (["--cache", "lfu"], "--cache"), (["--scheduler", "random"], "--scheduler")):
        result = run(*args)
        assert result.exit_code == 2 and option in result.output


def test_missing_profile_is_reported():
    result = run("--profile", "/nonexistent/profile.json")
    assert result.exit_code == 2 and "--profile" in result.output

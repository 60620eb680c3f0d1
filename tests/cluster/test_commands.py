import json

from click.testing import CliRunner

from nebula_engine.cluster.commands import simulate
from nebula_engine.workloads.registry import BUNDLED_DIR


def run(*args):
    return CliRunner().invoke(simulate, list(args))


def test_json_report_on_bundled_ragpulse_slice():
    result = run("--data", str(BUNDLED_DIR), "--limit", "60", "--qps", "20", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["workload"] == "ragpulse" and report["num_requests"] == 60
    assert 0 < report["cache_hit_ratio"] < 1 and report["ttft_p50_s"] > 0


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

"""`nebula-engine profile`: the fits, and a whole profile of a tiny Qwen3 that the simulator loads."""

import json

import pytest
from click.testing import CliRunner

from nebula_engine.bench.profile import combine_costs, fit_link, fit_prefill
from nebula_engine.cli.profile import profile
from nebula_engine.cli.simulate import simulate
from nebula_engine.cluster.control.config import ClusterProfile
from nebula_engine.workloads.registry import BUNDLED_DIR
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)


def test_prefill_fit_recovers_its_terms_and_drops_a_negative_one():
    samples = [(n, 0.01 + 2e-4 * n + 1e-8 * n * n / 2) for n in (16, 64, 256, 1024)]
    model = fit_prefill(samples)
    assert (model.fixed_s, model.per_token_s, model.attention_s) == pytest.approx((0.01, 2e-4, 1e-8), rel=1e-6)
    linear = fit_prefill([(n, 1e-4 * n - 1e-9 * n * n) for n in (100, 200, 400)])  # a curve bending down
    assert linear.attention_s == 0.0 and linear.per_token_s > 0


def test_link_fit_recovers_latency_and_bandwidth():
    link = fit_link([(b, 1e-3 + b / 2e9) for b in (4096, 65536, 1 << 20, 1 << 24)])
    assert link.latency_s == pytest.approx(1e-3) and link.bandwidth_bytes_per_s == pytest.approx(2e9)


def test_combine_costs_are_ratios_to_a_plain_prefill():
    rows = [{"backend": "plain prefill", "seconds": 2.0}, {"backend": "epic", "seconds": 0.5},
            {"backend": "full", "seconds": 2.2}]
    assert combine_costs(rows) == {"epic": 0.25, "full": 1.1}


@pytest.fixture(scope="module")
def tiny_qwen3(checkpoint_factory):  # noqa: F811
    return checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"])


def test_a_measured_profile_drives_the_simulator(tiny_qwen3, tmp_path):
    out = tmp_path / "profile.json"
    # the default best of 3 runs per length: with one, noise on a busy machine once fitted the per-token term to 0
    result = CliRunner().invoke(profile, ["--model", str(tiny_qwen3), "--out", str(out), "--num-pages", "256",
                                          "--backend", "epic", "--transfer", "copy"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    loaded = ClusterProfile.load(out)
    assert loaded.pic_backend == "epic" and set(loaded.combine_cost) == {"epic"}
    assert loaded.prefill.per_token_s > 0 and loaded.shared_compute and loaded.node_cores >= 1
    assert loaded.cache_capacity_tokens == 256 * 16 and loaded.kv_bytes_per_token > 0
    assert data["sources"]["transfer"] == "copy" and "in-process page copy" in data["sources"]["intra_node"]
    run = CliRunner().invoke(simulate, ["--data", str(BUNDLED_DIR), "--limit", "20", "--workers", "2",
                                        "--profile", str(out), "--first-token-at", "prefill", "--json"])
    assert run.exit_code == 0, run.output
    assert json.loads(run.output)["profile"] == loaded.name


def test_a_model_the_engine_cannot_load_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(profile, ["--model", str(tmp_path), "--out", str(tmp_path / "p.json")])
    assert result.exit_code != 0 and "profiling" in result.output

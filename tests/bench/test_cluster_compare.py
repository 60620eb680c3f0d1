"""A reduced ``nebula-engine compare``: the three policies on real local clusters (tiny model, few requests).

Checks what a user relies on: the command's output (progress, the table and its legend, where files went),
the shape of ``compare.json``, that no request failed, that each policy's hit ratio stays within the slice's
reuse bound, that PIC hits more than prefix caching, and that the PNG is written.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from nebula_engine.cli.compare import compare
from nebula_engine.cluster.control.policy_names import POLICY_NAMES as POLICIES
from nebula_engine.cluster.runtime.transfer import nixl_available
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

ROW_KEYS = {"policy", "num_requests", "completed", "failed", "ttft_p50_s", "ttft_p99_s", "cache_hit_ratio",
            "prompt_tokens", "cached_tokens", "transfer_bytes", "ttfts_s",
            "peer_cpu_s", "host_steal"}


def test_a_reduced_compare_runs_every_policy_and_writes_its_json_and_png(checkpoint_factory, tmp_path, monkeypatch):
    model = checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"])
    out = tmp_path / "results"
    monkeypatch.chdir(tmp_path)  # --write-docs writes docs/results/ under the working directory
    result = CliRunner().invoke(compare, [
        "--model", str(model), "--num-requests", "8", "--qps", "8", "--prefill-workers", "2",
        "--decode-workers", "0", "--threads-per-peer", "1", "--num-pages", "256", "--page-size", "4",
        "--max-prompt-tokens", "160", "--max-tokens", "2", "--out", str(out), "--write-docs"])
    assert result.exit_code == 0, result.output + repr(result.exception)

    document = json.loads((out / "compare.json").read_text())
    assert set(document) >= {"model", "options", "hit_ratio_bound", "pc_hit_ratio_bound", "rows"}
    assert document["options"]["kv_tokens_per_peer"] == 1024
    rows = {row["policy"]: row for row in document["rows"]}
    assert list(rows) == list(POLICIES)
    bound = document["hit_ratio_bound"]
    for policy, row in rows.items():
        assert ROW_KEYS <= set(row), policy
        assert row["failed"] == 0 and row["completed"] == 8, row["errors"]
        assert len(row["ttfts_s"]) == 8 and 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert 0 <= row["cache_hit_ratio"] <= bound, (policy, row["cache_hit_ratio"], bound)
        assert row["peer_cpu_s"] is None or row["peer_cpu_s"] > 0  # the peers prefilled 8 prompts
        assert row["host_steal"] is None or 0 <= row["host_steal"] <= 1
    assert rows["pc"]["cache_hit_ratio"] <= document["pc_hit_ratio_bound"]
    # recomputed tokens count as misses, so on this short slice local-pic can tie pc
    assert rows["local-pic"]["cache_hit_ratio"] >= rows["pc"]["cache_hit_ratio"]
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for policy in POLICIES:
        assert (out / "logs" / policy / "prefill-0.log").exists()

    for policy in POLICIES:  # progress, then one table with its legend, then where everything went
        assert f"{policy:<10} 8/8 requests in" in result.output
    assert "CHR: cache hit ratio" in result.output and "reuse bound" in result.output
    assert str(out / "compare.png") in result.output and str(out / "logs") in result.output

    page = (tmp_path / "docs" / "results" / "main-job.md").read_text()  # the results page, with the same rows
    for policy in POLICIES:
        assert f"| {policy} | {rows[policy]['ttft_p50_s']:.3f} | " in page
    assert (tmp_path / "docs" / "results" / "main-job.png").read_bytes() == (out / "compare.png").read_bytes()


def test_the_table_compares_with_the_first_policy_when_pc_did_not_run():
    from nebula_engine.bench.cluster_compare import format_table

    rows = [{"policy": policy, "ttft_p50_s": p50, "ttft_p99_s": 2 * p50, "cache_hit_ratio": 0.3, "failed": 0,
             "transfer_bytes": 0} for policy, p50 in (("local-pic", 0.2), ("nebula", 0.1))]
    nebula_line = next(line for line in format_table(rows).splitlines() if line.startswith("nebula"))
    assert "0.50" in nebula_line.split()  # p50 ratio against local-pic
    assert nebula_line.split()[-2:] == ["n/a", "n/a"]  # peer CPU and steal unknown


def test_steal_is_the_share_of_cpu_jiffies_stolen_between_two_readings(tmp_path):
    from nebula_engine.bench.host_cpu import cpu_jiffies, steal_share

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 50 0 25 400 5 0 0 20 0 0\n")
    before = cpu_jiffies(stat)
    assert before == (40, 1000)
    stat.write_text("cpu  150 0 50 850 10 0 0 140 0 0\n")
    assert steal_share(before, cpu_jiffies(stat)) == 100 / 200
    assert steal_share(before, None) is None and steal_share(before, before) is None
    stat.write_text("intr 1 2 3\n")
    assert cpu_jiffies(stat) is None and cpu_jiffies(tmp_path / "missing") is None

"""``nebula-engine compare``'s options, checked without starting a cluster (tests/bench/test_cluster_compare.py runs
one)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from nebula_engine.bench import cluster_compare
from nebula_engine.cli.compare import compare


def test_an_unknown_policy_is_a_usage_error_before_any_cluster_starts(tmp_path):
    result = CliRunner().invoke(compare, ["--policy", "fastest", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "fastest" in result.output and "nebula" in result.output
    assert not (tmp_path / "logs").exists()


def test_compare_write_docs_writes_the_main_job_page(tmp_path, monkeypatch):
    """The CLI flag alone, with the clusters replaced by what ``compare`` writes (its JSON and plot)."""
    row = dict(policy="pc", ttft_p50_s=0.5, ttft_p99_s=1.0, cache_hit_ratio=0.25, failed=0, transfer_bytes=0,
               peer_cpu_s=10.0, host_steal=0.0)

    def fake_compare(model, options, out_dir, data_dir=None):
        out_dir.mkdir(parents=True)
        (out_dir / "compare.json").write_text(json.dumps(
            {"model": model, "options": {**options.__dict__}, "hit_ratio_bound": 0.4, "pc_hit_ratio_bound": 0.3,
             "rows": [row]}))
        (out_dir / "compare.png").write_bytes(b"\x89PNG")
        return [row]

    monkeypatch.setattr(cluster_compare, "compare", fake_compare)
    monkeypatch.setattr(cluster_compare, "bench_model_dir", lambda: tmp_path / "bench-qwen3")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(compare, ["--policy", "pc", "--out", "run", "--write-docs"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    page = tmp_path / "docs" / "results" / "main-job.md"
    assert f"wrote {page.relative_to(tmp_path)}" in result.output
    assert "| pc | 0.500 | 1.000 | 25.0% | 1.00 | 1.00 | 0 | 0.0 MB | 10.0s | 0.0% |" in page.read_text()
    assert "Written by `" in page.read_text() and (tmp_path / "docs" / "results" / "main-job.png").exists()

import json

import pytest
from click.testing import CliRunner

from nebula_engine.cli.analyze import analyze


@pytest.fixture
def run(monkeypatch, tmp_path):
    monkeypatch.setenv("NEBULA_TRACES", str(tmp_path / "no-traces-here"))

    def invoke(*args: str):
        return CliRunner().invoke(analyze, list(args))
    return invoke


def test_ragpulse_falls_back_to_the_bundled_slice(run):
    result = run("ragpulse")
    assert result.exit_code == 0, result.output
    assert "bundled" in result.output and "1,000 requests" in result.output
    assert "31.39" in result.output and "31.53" in result.output  # ours beside the paper's


def test_full_ragpulse_prints_the_paper_figures(run, shared_traces):
    result = run("ragpulse", "--data", str(shared_traces))
    assert result.exit_code == 0, result.output
    pc_line = next(line for line in result.output.splitlines() if line.strip().startswith("PC%"))
    pic_line = next(line for line in result.output.splitlines() if line.strip().startswith("PIC%"))
    assert pc_line.split()[1:] == ["31.53", "31.53"]
    assert pic_line.split()[1:] == ["72.01", "72.01"]


def test_json_output(run):
    payload = json.loads(run("ragpulse", "--limit", "50", "--json").output)
    assert payload["workload"] == "ragpulse" and payload["ours"]["requests"] == 50
    assert payload["paper"]["pc"] == 31.53
    assert payload["hit_ratio_bound"] == pytest.approx(payload["ours"]["pic"] / 100)
    assert payload["pc_hit_ratio_bound"] == pytest.approx(payload["ours"]["pc"] / 100)
    assert any("first 50 trace lines" in note for note in payload["notes"])


def test_synthetic_workloads_say_so(run):
    result = run("quac", "--limit", "100")
    assert result.exit_code == 0 and "SYNTHETIC" in result.output


def test_missing_data_dir_is_a_usage_error_naming_the_path(run, tmp_path):
    result = run("tau-bench", "--data", str(tmp_path / "nowhere"))
    assert result.exit_code == 2
    assert str(tmp_path / "nowhere" / "tau_bench_retail") in result.output
    assert "Traceback" not in result.output


def test_missing_data_file_is_reported(run, tmp_path):
    (tmp_path / "ragpulse").mkdir()
    result = run("ragpulse", "--data", str(tmp_path))
    assert result.exit_code == 1
    assert f"missing ragpulse data file: {tmp_path / 'ragpulse'}/" in result.output


def test_empty_data_dir_is_reported(run, tmp_path):
    (tmp_path / "chatdev" / "WareHouse").mkdir(parents=True)
    result = run("chatdev", "--data", str(tmp_path))
    assert result.exit_code == 1 and "no chatdev requests" in result.output


def test_unknown_workload_is_rejected(run):
    assert run("nope").exit_code == 2


def test_chatdev_reports_rebuilt_vs_logged_size(run, shared_traces):
    result = run("chatdev", "--data", str(shared_traces), "--limit", "2")
    assert result.exit_code == 0, result.output
    assert "rebuilt / logged prompt_tokens: median" in result.output
    assert "tokens: qwen3" in result.output  # the paper serves ChatDev with Qwen3


def test_tokenizer_file_gives_real_counts(run, shared_traces, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    result = run("tau-bench", "--data", str(shared_traces), "--limit", "2", "--tokenizer", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert f"tokens: tokenizer file {tmp_path}" in result.output
    assert run("tau-bench", "--tokenizer", str(tmp_path / "none.json")).exit_code == 2


def test_tau_bench_counts_tokens_with_the_papers_tokenizer(run, shared_traces):
    """Point 8: the retail policy is 1,236 Qwen3.5 tokens (the paper's 1,240-token segment), not 1,420 (chars/4)."""
    payload = json.loads(run("tau-bench", "--data", str(shared_traces), "--limit", "3", "--json").output)
    assert payload["ours"]["segment_length"]["p99"] == 1236.0
    assert any("tokens: qwen3.5" in note for note in payload["notes"])
    estimate = json.loads(run("tau-bench", "--data", str(shared_traces), "--limit", "3", "--tokenizer", "chars/4",
                              "--json").output)
    assert estimate["ours"]["segment_length"]["p99"] == 1420.0

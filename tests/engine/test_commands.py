from click.testing import CliRunner

from nebula_engine.engine.commands import generate


def test_generate_runs_on_given_model_and_prints_outputs_and_throughput(qwen3_dir):
    result = CliRunner().invoke(generate, ["--model", str(qwen3_dir), "--prompt", "Hello", "--prompt", "Two words",
                                           "--max-tokens", "3", "--temperature", "0.8", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "prompt: 'Hello'" in result.output and "prompt: 'Two words'" in result.output
    assert result.output.count("[3 tokens, length]") == 2
    assert "2 requests" in result.output and "tok/s" in result.output


def test_generate_with_no_arguments_builds_and_uses_the_tiny_default(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    result = CliRunner().invoke(generate, ["--max-tokens", "2", "--chat"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "nebula-engine" / "tiny-qwen3" / "config.json").is_file()
    assert "4 requests" in result.output


def test_bad_values_are_click_errors_naming_the_option(qwen3_dir):
    runner = CliRunner()
    cases = [
        (["--top-p", "0"], "--top-p"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--dtype", "float64"], "--dtype"),
        (["--model", "/no/such/dir"], "no checkpoint directory"),
        (["--model", str(qwen3_dir), "--prompt", ""], "prompt is empty"),
    ]
    for args, message in cases:
        result = runner.invoke(generate, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output

from click.testing import CliRunner

from nebula_engine.cli.generate import generate


def test_generate_runs_on_given_model_and_prints_outputs_and_throughput(qwen3_dir):
    result = CliRunner().invoke(generate, ["--model", str(qwen3_dir), "--prompt", "Hello", "--prompt", "Two words",
                                           "--max-tokens", "3", "--temperature", "0.8", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "prompt: 'Hello'" in result.output and "prompt: 'Two words'" in result.output
    assert result.output.count("[3 tokens, length]") == 2
    assert "2 requests" in result.output and "tok/s" in result.output


def test_generate_with_no_model_answers_with_the_default_qwen(qwen05_path):
    """The default is the real Qwen2.5-Coder-0.5B-Instruct that ``make install`` downloads."""
    result = CliRunner().invoke(generate, ["--chat", "--max-tokens", "8", "--prompt",
                                           "What is the capital of France? Answer in one word."])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output and "1 requests" in result.output


def test_generate_without_the_default_model_says_how_to_fetch_it(monkeypatch, tmp_path):
    monkeypatch.setenv("NEBULA_MODELS_DIR", str(tmp_path))
    result = CliRunner().invoke(generate, ["--max-tokens", "2"])
    assert result.exit_code == 2
    assert "nebula-engine download qwen2.5-coder-0.5b" in result.output


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

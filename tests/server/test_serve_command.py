"""``serve``'s security flags are refused when they cannot take effect, before any model is loaded."""

from click.testing import CliRunner

from nebula_engine.server.commands import serve


def test_an_empty_api_key_is_an_error_not_an_open_server():
    result = CliRunner().invoke(serve, ["--model", "/nonexistent"], env={"NEBULA_API_KEY": " "})
    assert result.exit_code == 2 and "API key is empty" in result.output


def test_a_cluster_refuses_security_flags_it_would_not_apply():
    result = CliRunner().invoke(serve, ["--prefill-workers", "2", "--api-key", "k"])
    assert result.exit_code == 2 and "not passed to cluster peers" in result.output
    result = CliRunner().invoke(serve, ["--prefill-workers", "2", "--max-request-bytes", "10"])
    assert result.exit_code == 2 and "not passed to cluster peers" in result.output

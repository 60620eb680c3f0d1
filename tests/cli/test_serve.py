"""``serve``'s security flags: refused when empty, before any model is loaded; handed to every peer of a cluster."""

from click.testing import CliRunner

from nebula_engine.cli.serve import serve


def test_an_empty_api_key_is_an_error_not_an_open_server():
    result = CliRunner().invoke(serve, ["--model", "/nonexistent"], env={"NEBULA_API_KEY": " "})
    assert result.exit_code == 2 and "API key is empty" in result.output


def test_a_cluster_hands_its_security_flags_to_every_peer():
    from nebula_engine.cluster.runtime.launcher import LocalCluster, local_spec
    from nebula_engine.cli.serve import _peer_settings

    settings = _peer_settings("k", 1234, None, None, 3.0, 10.0, None, None, None, None)
    assert settings.api_key == "k" and settings.max_request_bytes == 1234
    cluster = LocalCluster("/nonexistent", local_spec(1, 0), settings=settings)
    try:
        args = cluster._settings_args()
        assert args[args.index("--max-request-bytes") + 1] == "1234"
        assert cluster._peer_env()["NEBULA_API_KEY"] == "k"
    finally:
        cluster.stop()


def test_tool_call_parser_is_checked_before_any_model_is_loaded():
    result = CliRunner().invoke(serve, ["--model", "/nonexistent", "--tool-call-parser", "nope"])
    assert result.exit_code == 2 and "'nope' is not one of" in result.output
    result = CliRunner().invoke(serve, ["--model", "/nonexistent", "--prefill-workers", "1",
                                        "--tool-call-parser", "hermes"])
    assert result.exit_code == 2 and "are for one engine" in result.output

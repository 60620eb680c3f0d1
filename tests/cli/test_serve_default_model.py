"""``serve`` without --model uses the default catalog model; where it is not downloaded, it names the command that
fetches it before starting anything (one engine or a local cluster)."""

import pytest
from click.testing import CliRunner

from nebula_engine.cli.serve import serve


@pytest.mark.parametrize("args", [[], ["--prefill-workers", "1"]], ids=["one-engine", "local-cluster"])
def test_serve_without_the_default_model_says_how_to_fetch_it(args, monkeypatch, tmp_path):
    monkeypatch.setenv("NEBULA_MODELS_DIR", str(tmp_path))
    result = CliRunner().invoke(serve, ["--port", "0", *args])
    assert result.exit_code == 2, result.output
    assert "'qwen2.5-coder-0.5b'" in result.output
    assert "is not downloaded; fetch it with: nebula-engine download qwen2.5-coder-0.5b" in result.output

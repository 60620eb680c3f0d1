import pytest

from nebula_engine.workloads.registry import (
    BUNDLED_DIR, WORKLOADS, WorkloadDataMissing, load_workload, resolve_source,
)
from nebula_engine.workloads.paper_figures import PAPER_FIGURES


def test_every_workload_has_paper_figures():
    assert set(WORKLOADS) == set(PAPER_FIGURES) == {"ragpulse", "tau-bench", "chatdev", "swe-agent", "doc2dial", "quac"}


def test_unknown_workload_is_named():
    with pytest.raises(KeyError, match="nope"):
        load_workload("nope")


def test_missing_default_traces_fall_back_to_the_bundled_ragpulse(tmp_path, monkeypatch):
    monkeypatch.setenv("NEBULA_TRACES", str(tmp_path / "absent"))
    source = resolve_source("ragpulse")
    assert source.bundled and source.directory == BUNDLED_DIR / "ragpulse"
    assert len(load_workload("ragpulse", limit=3)) == 3


def test_env_var_names_the_traces_dir(tmp_path, monkeypatch):
    (tmp_path / "chatdev").mkdir()
    monkeypatch.setenv("NEBULA_TRACES", str(tmp_path))
    assert resolve_source("chatdev").directory == tmp_path / "chatdev"


def test_explicit_missing_dir_never_falls_back(tmp_path):
    with pytest.raises(WorkloadDataMissing, match=str(tmp_path / "ragpulse")):
        resolve_source("ragpulse", tmp_path)
    with pytest.raises(WorkloadDataMissing):
        resolve_source("tau-bench", tmp_path)


def test_generators_need_no_data():
    assert resolve_source("quac", "/nonexistent").directory is None

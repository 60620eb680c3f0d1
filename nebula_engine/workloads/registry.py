"""Workloads by the name users type: `load_workload("ragpulse")` and friends.

Loaders are imported lazily so that loading one workload never pays for parsing code of another.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from nebula_engine.data import bundled_dir
from nebula_engine.workloads.request import Request
from nebula_engine.workloads.segments import LoadOptions, Tokenizer
from nebula_engine.workloads.tokenizers import ESTIMATE, named_tokenizer

TRACES_ENV = "NEBULA_TRACES"
DEFAULT_TRACES_DIR = Path("../shared/traces")
BUNDLED_DIR = bundled_dir()  # nebula_engine/data, one folder per bundled trace slice


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    module: str  # nebula_engine.workloads.<module>
    loader: str  # function(directory: Path | None, options: LoadOptions) -> list[Request]
    subdir: str | None  # under the traces dir; None for generators that need no data
    bundled: bool = False  # a slice ships in nebula_engine/data/<subdir>
    synthetic: bool = False
    limit_unit: str = "requests"
    token_lengths: str = "text"  # "text": counted from text; otherwise where the lengths come from
    tokenizer: str = ESTIMATE  # how text is counted unless the caller says (workloads.tokenizers)
    notes: tuple[str, ...] = ()

    def load(self, directory: Path | None, options: LoadOptions) -> list[Request]:
        loader = getattr(importlib.import_module(f"nebula_engine.workloads.{self.module}"), self.loader)
        return loader(directory, options)


WORKLOADS: dict[str, WorkloadSpec] = {spec.name: spec for spec in (
    WorkloadSpec("ragpulse", "ragpulse", "load_ragpulse", "ragpulse", bundled=True, limit_unit="trace lines",
                 token_lengths="trace lengths (Qwen2.5 tokens)"),
    WorkloadSpec("tau-bench", "tau_bench", "load_tau_bench", "tau_bench_retail", limit_unit="conversations",
                 tokenizer="qwen3.5", notes=("the 69 real GPT-4o retail conversations, sessions starting as a seeded Poisson "
                        "process",)),
    WorkloadSpec("chatdev", "chatdev", "load_chatdev", "chatdev", limit_unit="run logs", tokenizer="qwen3",
                 notes=("one request per logged LLM call of the WareHouse run logs",)),
    WorkloadSpec("swe-agent", "swe_agent", "load_swe_agent", "swe_agent", limit_unit="trajectories",
                 notes=("PROXY: nebius/SWE-agent-trajectories is unavailable; uses the 13 SWE-agent .traj "
                        "files and the mini-swe-agent (Gemini 3 Pro) trajectories",)),
    WorkloadSpec("doc2dial", "synthetic_rag", "generate_doc2dial", None, synthetic=True,
                 token_lengths="synthetic lengths",
                 notes=("SYNTHETIC: ChatRAG-doc2dial raw data is unavailable; seeded generator shaped to "
                        "the paper's Table 1/2",)),
    WorkloadSpec("quac", "synthetic_rag", "generate_quac", None, synthetic=True,
                 token_lengths="synthetic lengths",
                 notes=("SYNTHETIC: ChatRAG-QuAC raw data is unavailable; seeded generator shaped to "
                        "the paper's Table 1/2",)),
)}


class WorkloadDataMissing(FileNotFoundError):
    """The data directory a workload needs does not exist."""


@dataclass(frozen=True)
class DataSource:
    directory: Path | None
    bundled: bool  # True when the packaged slice stands in for a missing traces dir


def get_spec(name: str) -> WorkloadSpec:
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def default_traces_dir() -> Path:
    return Path(os.environ.get(TRACES_ENV) or DEFAULT_TRACES_DIR)


def resolve_source(name: str, data_dir: Path | str | None = None) -> DataSource:
    """Where a workload's data lives; the bundled slice replaces a missing default traces dir."""
    spec = get_spec(name)
    if spec.subdir is None:
        return DataSource(None, bundled=False)
    explicit = data_dir is not None
    directory = Path(data_dir if explicit else default_traces_dir()) / spec.subdir
    if directory.is_dir():
        return DataSource(directory, bundled=False)
    if spec.bundled and not explicit:
        return DataSource(BUNDLED_DIR / spec.subdir, bundled=True)
    raise WorkloadDataMissing(f"no {name} data: directory {directory} does not exist")


def load_workload(name: str, data_dir: Path | str | None = None, limit: int | None = None,
                  tokenizer: Tokenizer | str | None = None, seed: int = 0,
                  with_token_ids: bool = False) -> list[Request]:
    """Requests of a workload in trace order. ``limit`` counts the unit in ``WORKLOADS[name].limit_unit``.

    ``tokenizer``: a callable, a name of ``workloads.tokenizers``, or None for the workload's own default."""
    source = resolve_source(name, data_dir)
    options = LoadOptions(limit=limit, tokenizer=resolve_tokenizer(name, tokenizer), seed=seed,
                          with_token_ids=with_token_ids)
    return get_spec(name).load(source.directory, options)


def resolve_tokenizer(name: str, tokenizer: Tokenizer | str | None) -> Tokenizer | None:
    if callable(tokenizer):
        return tokenizer
    return named_tokenizer(get_spec(name).tokenizer if tokenizer is None else tokenizer)

"""Suite-wide setup that must run before any test module imports triton, the session-wide real model, and
how ``make test`` spreads the suite over pytest-xdist workers.

Without a GPU, Triton kernels can only run in its interpreter, and triton reads ``TRITON_INTERPRET`` when it
is first imported: set it here, first, so kernel tests work in any order.

``make test`` runs ``pytest -n 2 --dist loadgroup``. Tests that start clusters of peer processes share one
group, so that at most one cluster runs at a time, as when the suite ran serially; tests of the real model
share another, so that it is loaded by one worker only. Each worker's torch uses one intra-op thread: two
workers on two cores would otherwise oversubscribe them.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# modules whose tests start peer processes (clusters, etcd, Raft nodes), relative to the repository root
CLUSTER_MODULES = frozenset({
    "tests/cluster/test_cluster_e2e.py", "tests/cluster/test_cluster_lifecycle.py",
    "tests/cluster/test_multihost.py", "tests/cluster/test_election.py",
    "tests/bench/test_cluster_compare.py",
})


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parent.parent
    for item in items:
        module = Path(item.fspath).resolve().relative_to(root).as_posix()
        if module in CLUSTER_MODULES:
            item.add_marker(pytest.mark.xdist_group("cluster"))
        elif "smollm2_llm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("smollm2"))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The installed SmolLM2-135M-Instruct GGUF (``make install`` installs it); skipped, saying how to
    install it, where it is absent."""
    from nebula_engine.config import resolve_model

    try:
        return Path(resolve_model("smollm2"))
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct's GGUF, which ``make install`` downloads; skipped, naming the command that
    fetches it, where it is absent (but not in CI, whose ``make install`` must have fetched it)."""
    from nebula_engine.catalog import ModelNotDownloaded, resolve_model

    try:
        return Path(resolve_model("qwen2.5-coder-0.5b"))
    except ModelNotDownloaded as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    """SmolLM2 through our engine, fp32, loaded once for the whole suite (a load takes seconds)."""
    pytest.importorskip("gguf", reason="SmolLM2 is a GGUF file: pip install 'nebula-engine[gguf]'")
    from nebula_engine import LLM

    return LLM(str(smollm2_path), dtype="float32", page_size=16, num_pages=256)

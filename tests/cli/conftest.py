"""Fixtures of the command tests: the tiny checkpoint the engine tests use and the shared traces."""

import pytest

from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)
from tests.workloads.conftest import shared_traces  # noqa: F401  (fixture)


@pytest.fixture(scope="session")
def qwen3_dir(checkpoint_factory):  # noqa: F811
    return checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"])

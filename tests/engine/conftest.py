import pytest

from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)


@pytest.fixture(scope="session")
def qwen3_dir(checkpoint_factory):
    return checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"])


@pytest.fixture(scope="session")
def llm(qwen3_dir):
    """One shared engine for tests that only need some model; each test must leave it idle."""
    from nebula_engine import LLM

    return LLM(str(qwen3_dir), num_pages=256, page_size=8, max_num_batched_tokens=64)

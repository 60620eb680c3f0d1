from pathlib import Path

import pytest

SHARED_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


@pytest.fixture
def shared_traces() -> Path:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"{SHARED_TRACES} not present")
    return SHARED_TRACES

"""Suite-wide setup that must run before any test module imports triton, and the session-wide real model.

Without a GPU, Triton kernels can only run in its interpreter, and triton reads ``TRITON_INTERPRET`` when it
is first imported: set it here, first, so kernel tests work in any order.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
def smollm2_llm(smollm2_path):
    """SmolLM2 through our engine, fp32, loaded once for the whole suite (a load takes seconds)."""
    pytest.importorskip("gguf", reason="SmolLM2 is a GGUF file: pip install 'nebula-engine[gguf]'")
    from nebula_engine import LLM

    return LLM(str(smollm2_path), dtype="float32", page_size=16, num_pages=256)

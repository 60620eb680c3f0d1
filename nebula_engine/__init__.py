"""Nebula: LLM inference with cluster-wide position-independent KV caching.

``import nebula_engine`` stays light (no torch): ``LLM`` is imported on first access.
"""

from __future__ import annotations

import importlib

from nebula_engine.engine.outputs import CompletionOutput, Logprob, RequestOutput
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]

_LAZY = {"LLM": "nebula_engine.engine.llm"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nebula_engine' has no attribute {name!r}")

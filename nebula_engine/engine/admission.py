"""Admission: the one place a request (prompt, sampling params, PIC backend spec) is checked against an engine.

``admit`` turns what a caller gave into an ``AdmittedRequest``: the prompt's token ids (and its PIC segments),
its ``SamplingParams`` and the PIC backend it runs with, resolved. ``LLM``, ``AsyncLLMEngine`` and the cluster
front end admit each request once; ``LLMEngine.add_admitted`` and the layers after it take it as it is.

A backend spec is a string (``epic``, ``cacheblend:ratio=0.3``, ``auto``, ...), None (PIC off, the same token ids)
or ``ENGINE_DEFAULT`` (the backend the engine was configured with), which is what callers that name none pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.pic.backends import PICBackend
from nebula_engine.pic.segments import SegmentedPrompt

if TYPE_CHECKING:
    from nebula_engine.engine.llm_engine import LLMEngine

ENGINE_DEFAULT = "default"  # the backend spec that names the engine's configured PIC backend

EnginePrompt = Union[list[int], SegmentedPrompt]


@dataclass(frozen=True)
class AdmittedRequest:
    """A request an engine can serve, checked once (``admit``); whoever gets one does not check it again."""

    token_ids: tuple[int, ...]
    segmented: SegmentedPrompt | None  # the prompt's PIC segments; None for a plain token-id prompt
    params: SamplingParams
    backend: PICBackend | None  # the PIC backend it runs with (its segments are combined by it); None: PIC off
    text: str | None = None  # the prompt as text, echoed in its outputs


def admit(engine: LLMEngine, prompt: EnginePrompt, params: SamplingParams, pic_backend: str | None = ENGINE_DEFAULT,
          text: str | None = None) -> AdmittedRequest:
    """``prompt`` (token ids, or a ``SegmentedPrompt`` marking PIC segments) with ``params`` and the backend spec
    ``pic_backend``, checked against ``engine``; ValueError naming the problem for a request it cannot serve.
    Reads only what ``LLMEngine.__init__`` set (and the thread-safe grammar cache), so any thread may call it."""
    segmented = prompt if isinstance(prompt, SegmentedPrompt) else None
    token_ids = list(segmented.token_ids) if segmented is not None else prompt
    _check_prompt(engine, token_ids)
    _check_params(engine, params)
    backend = engine.resolve_request_backend(pic_backend)
    return AdmittedRequest(tuple(token_ids), segmented, params, backend, text)


def _check_prompt(engine: LLMEngine, token_ids: list[int]) -> None:
    if not token_ids:
        raise ValueError("prompt is empty: it must contain at least one token")
    vocab = engine.model_config.vocab_size
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
    if len(token_ids) >= engine.max_model_len:
        raise ValueError(f"prompt of {len(token_ids)} tokens leaves no room to generate: "
                         f"max_model_len is {engine.max_model_len}")


def _check_params(engine: LLMEngine, params: SamplingParams) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    vocab = engine.model_config.vocab_size
    if len(params.stop_token_ids) > vocab:  # more than the vocabulary: repeats, checked on every token
        raise ValueError(f"stop_token_ids holds {len(params.stop_token_ids)} ids; the vocabulary has {vocab}")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"stop_token_ids {bad[:5]} outside the vocabulary [0, {vocab})")
    bad = [t for t in (params.logit_bias or {}) if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"logit_bias token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
    if engine.tokenizer is None and (params.stop or params.structured_outputs is not None):
        raise ValueError("stop strings and structured outputs need a tokenizer; this engine was started with "
                         "skip_tokenizer_init")
    if params.structured_outputs is not None:
        engine.grammar_compiler.compile(params.structured_outputs)  # ValueError for an invalid schema / grammar

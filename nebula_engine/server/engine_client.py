"""``EngineClient``: everything the HTTP API needs from whatever generates tokens.

Implemented by ``AsyncLLMEngine`` (one local engine) and by the cluster front end (forwards to the router).
The API does its own request-level accounting (TTFT, cached tokens from each ``RequestOutput``), so a client
only reports what the API cannot see: queue lengths.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol, runtime_checkable

from nebula_engine.engine.async_engine import EngineDeadError, EngineError, EnginePrompt, EngineStats
from nebula_engine.engine.llm_engine import DEFAULT_BACKEND
from nebula_engine.engine.outputs import RequestOutput
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.tokenizer import Tokenizer

__all__ = ["DEFAULT_BACKEND", "EngineClient", "EngineDeadError", "EngineError", "EnginePrompt", "EngineStats"]


@runtime_checkable
class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Tokenizer:
        """Turns request text (and ``<pic>`` tags) into the token ids the engine runs."""

    @property
    def max_model_len(self) -> int:
        """Prompt + generated tokens one request may hold."""

    def generate(self, request_id: str, prompt: EnginePrompt, params: SamplingParams,
                 pic_backend: str | None | object = DEFAULT_BACKEND, route: str | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs, the last one ``finished``. ``route`` (clusters): the peer that runs the prefill. ``ValueError`` (on the first iteration) means the
        request is invalid; ``EngineError`` means the engine failed it. Closing the iterator early aborts."""

    def abort(self, request_id: str) -> None:
        """Stop ``request_id``; returns at once, a no-op for unknown or finished ids."""

    def stats(self) -> EngineStats:
        """Latest load snapshot (cheap: called on every metrics scrape)."""

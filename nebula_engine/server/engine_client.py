"""``EngineClient``: everything the HTTP API needs from whatever generates tokens.

Implemented by ``AsyncLLMEngine`` (one local engine) and by the cluster front end (forwards to the router).
The API does its own request-level accounting (TTFT, cached tokens from each ``RequestOutput``), so a client
only reports what the API cannot see: queue lengths.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol, runtime_checkable

from nebula_engine.engine.admission import ENGINE_DEFAULT, EnginePrompt
from nebula_engine.engine.async_engine import EngineDeadError, EngineError, EngineStats
from nebula_engine.engine.outputs import RequestOutput
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.tokenizer import Tokenizer

__all__ = ["ENGINE_DEFAULT", "EngineClient", "EngineDeadError", "EngineError", "EnginePrompt", "EngineStats"]


@runtime_checkable
class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Tokenizer:
        """Turns request text (and ``<pic>`` tags) into the token ids the engine runs."""

    @property
    def max_model_len(self) -> int:
        """Prompt + generated tokens one request may hold."""

    def generate(self, request_id: str, prompt: EnginePrompt, params: SamplingParams,
                 pic_backend: str | None = ENGINE_DEFAULT, route: str | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs, the last one ``finished``. The request is admitted (``admission.admit``) once,
        before anything is queued: ``ValueError`` (on the first iteration) means it is invalid; ``EngineError``
        means the engine failed it. ``pic_backend``: a spec, None (PIC off) or ``ENGINE_DEFAULT``. ``route``
        (clusters): the peer that runs the prefill. Closing the iterator early aborts."""

    def abort(self, request_id: str) -> None:
        """Stop ``request_id``; returns at once, a no-op for unknown or finished ids."""

    def stats(self) -> EngineStats:
        """Latest load snapshot (cheap: called on every metrics scrape)."""

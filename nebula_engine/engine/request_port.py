"""``RequestPort``: the engine's requests, as another component (a cluster peer) submits them.

Every request goes through the async engine's one submit path with one request-level ``KVPlan`` (``kv_plan``: hold
its pages for a hand-off, wait behind a KV gate, prefill only); a request prefilled on another engine continues
here from pages reserved for it. Requests are streamed by the async engine unchanged. Besides requests: the
checks a request passes before it is queued (``admit``, ``max_model_len``, the tokenizer), the engine's load
(``stats``) and its measured prefill speed. The KV cache itself is ``kv_port.KVPort``'s; the data both ports hand
out is in ``port_types``.
"""

from __future__ import annotations

import time
from typing import AsyncIterator, Mapping

import torch

from nebula_engine.engine.admission import ENGINE_DEFAULT, AdmittedRequest
from nebula_engine.engine.async_engine import AsyncLLMEngine, EnginePrompt
from nebula_engine.engine.kv_plan import ORDINARY, KVPlan
from nebula_engine.engine.llm_engine import LLMEngine
from nebula_engine.engine.outputs import RequestOutput
from nebula_engine.engine.port_types import EngineStats
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.tokenizer import Tokenizer
from nebula_engine.kernels.attention import AttentionContext

__all__ = ["ENGINE_DEFAULT", "AdmittedRequest", "EnginePrompt", "RequestPort"]


class RequestPort:
    """The requests of one engine: admitted and submitted here, streamed back by the async engine.

    ``backend_spec`` arguments are what ``LLMEngine.resolve_request_backend`` takes for a request."""

    def __init__(self, engine: AsyncLLMEngine):
        self._async = engine
        self.vocab_size: int = engine.engine.model_config.vocab_size  # token ids of a prompt lie in [0, vocab_size)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._async.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._async.max_model_len

    def admit(self, prompt: EnginePrompt, params: SamplingParams,
              pic_backend: str | None = ENGINE_DEFAULT) -> AdmittedRequest:
        """``AsyncLLMEngine.admit``: the request checked against this engine, its backend resolved; safe from any
        thread. Raises ``ValueError`` on bad input."""
        return self._async.admit(prompt, params, pic_backend)

    def stats(self) -> EngineStats:
        return self._async.stats()

    async def _call(self, fn):
        """``fn(engine)`` on the engine thread, between two steps."""
        return await self._async.call(fn)

    # ---- requests (streamed by the async engine) ----
    def generate(self, request_id: str, prompt: EnginePrompt, params: SamplingParams,
                 backend_spec, kv_plan: KVPlan = ORDINARY) -> AsyncIterator[RequestOutput]:
        """``kv_plan`` (``engine.kv_plan``): e.g. a gate, queued now and scheduled once the KV it waits for has
        arrived."""
        return self._async.generate(request_id, prompt, params, backend_spec, kv_plan=kv_plan)

    async def generate_held(self, request_id: str, prompt: EnginePrompt, params: SamplingParams,
                            backend_spec, kv_plan: KVPlan = KVPlan(hold=True)) -> RequestOutput:
        return await self._async.generate_held(request_id, prompt, params, backend_spec, kv_plan)

    async def release_held(self, request_id: str) -> None:
        await self._call(lambda e: e.release_held(request_id))

    async def prefill_prefix(self, request_id: str, token_ids: list[int]) -> int:
        """Prefill ``token_ids`` exactly (PIC off, no logits: ``AsyncLLMEngine.prefill``) so that their full pages
        enter the prefix cache; the tokens of them the prefix cache held before (what a later request counts as
        hits)."""
        return (await self._async.prefill(request_id, list(token_ids))).num_prefix_cached_tokens

    # ---- requests prefilled on another engine ----
    async def reserve_prefilled(self, request_id: str, num_tokens: int) -> list[int]:
        """Pages (and a state slot, for hybrid models) for a request prefilled on another peer
        (``LLMEngine.reserve_prefilled``)."""
        return await self._call(lambda e: e.reserve_prefilled(request_id, num_tokens))

    async def cancel_prefilled(self, request_id: str) -> None:
        await self._call(lambda e: e.cancel_prefilled(request_id))

    def generate_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token: int,
                           first_logprob: float, params: SamplingParams, cached: tuple[int, ...],
                           linear_state: Mapping[str, list[torch.Tensor]] | None = None
                           ) -> AsyncIterator[RequestOutput]:
        """``linear_state``: the prefill peer's ``KVPort.held_state`` (hybrid models; loaded into the reserved slot)."""
        return self._async.generate_prefilled(request_id, prompt_token_ids, first_token, first_logprob, params,
                                              cached, linear_state)

    # ---- profiling ----
    async def prefill_seconds_per_token(self, num_tokens: int = 256, repeats: int = 3) -> float:
        """Seconds per prefilled token of this model here, best of ``repeats`` forwards of ``num_tokens`` random
        tokens: the unit of a planner's prefill cost."""
        def measure(engine: LLMEngine) -> float:
            model = engine.model_runner.model
            device = next(model.parameters()).device
            ids = torch.randint(100, 1000, (num_tokens,), device=device)
            best = float("inf")
            with torch.inference_mode():
                for _ in range(repeats):
                    start = time.perf_counter()
                    model.forward(ids, torch.arange(num_tokens, device=device), AttentionContext.dense([num_tokens]))
                    best = min(best, time.perf_counter() - start)
            return best / num_tokens

        return await self._call(measure)

    def shutdown(self) -> None:
        """Stop the engine (``AsyncLLMEngine.shutdown``): requests still in flight fail with ``EngineDeadError``."""
        self._async.shutdown()

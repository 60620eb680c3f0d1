"""Offline inference API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import itertools
from typing import Any, Sequence, Union

from nebula_engine.config import EngineConfig
from nebula_engine.engine.llm_engine import LLMEngine
from nebula_engine.engine.outputs import RequestOutput
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.tokenizer import Message

PromptType = Union[str, dict[str, Any]]  # text, or {"prompt_token_ids": [...]}


class LLM:
    """``LLM(model, dtype="float32", device="cpu", **options)``.

    ``options`` are any field of ``EngineConfig`` / ``CacheConfig`` / ``SchedulerConfig``
    (``page_size``, ``num_pages``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
    ``attention_backend``, ``seed``, ...).
    """

    def __init__(self, model: str, **options: Any):
        self.llm_engine = LLMEngine(EngineConfig.create(model, **options))
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer.hf

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in input order. Invalid input raises ValueError first."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        requests = [self._tokenize(p) for p in prompts]
        return self._run(requests, self._params_per_prompt(sampling_params, len(requests)))

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation (a list of messages) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise ValueError("no conversation given")
        requests = [self.llm_engine.tokenizer.apply_chat_template(c) for c in conversations]
        return self._run(requests, self._params_per_prompt(sampling_params, len(requests)))

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.llm_engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        raise ValueError(f"a prompt is a string or a dict with 'prompt_token_ids', got {prompt!r:.80}")

    @staticmethod
    def _params_per_prompt(params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params

    def _run(self, requests: list[tuple[str | None, list[int]]], params: list[SamplingParams]) -> list[RequestOutput]:
        engine = self.llm_engine
        for (_, token_ids), p in zip(requests, params):
            engine.validate_request(token_ids, p)  # all of them before any is scheduled
        request_ids = [str(next(self._request_counter)) for _ in requests]
        for request_id, (text, token_ids), p in zip(request_ids, requests, params):
            engine.add_request(request_id, token_ids, p, prompt=text)
        results: dict[str, RequestOutput] = {}
        while len(results) < len(request_ids):
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = output
        return [results[i] for i in request_ids]

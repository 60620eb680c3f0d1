"""One engine: scheduler + KV pool + model runner + output processing, advanced one step at a time."""

from __future__ import annotations

import torch

from nebula_engine.config import EngineConfig, ModelConfig
from nebula_engine.engine.model_runner import ModelRunner
from nebula_engine.engine.output_processor import OutputProcessor
from nebula_engine.engine.outputs import RequestOutput
from nebula_engine.engine.sampler import Sampler
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.scheduler import Scheduler
from nebula_engine.engine.sequence import Sequence
from nebula_engine.engine.tokenizer import Tokenizer
from nebula_engine.kernels.attention import get_attention_backend
from nebula_engine.kvcache.pool import KVCacheManager, KVCacheStorage, num_pages_for_budget
from nebula_engine.kvcache.spec import full_attention_groups
from nebula_engine.model.loader import load_model


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        dtype = getattr(torch, config.dtype)
        model, self.model_config, checkpoint_dir = load_model(config.model, dtype, config.device)
        if getattr(model, "num_linear_layers", 0):
            raise ValueError(f"{self.model_config.model_type!r} has linear-attention layers, whose per-sequence "
                             "state the engine's KV pool does not hold yet")
        self.tokenizer = Tokenizer(checkpoint_dir)
        groups = full_attention_groups(model.kv_cache_shape_per_layer(), dtype)
        page_size = config.cache.page_size
        num_pages = config.cache.num_pages or num_pages_for_budget(groups, page_size, config.cache.kv_cache_memory_bytes)
        self.max_model_len = self._max_model_len(self.model_config, num_pages * page_size)
        self.scheduler = Scheduler(config.scheduler, KVCacheManager(num_pages, page_size))
        self.model_runner = ModelRunner(model, KVCacheStorage(groups, num_pages, page_size, config.device),
                                        get_attention_backend(config.attention_backend),
                                        Sampler(config.seed, config.device), config.device)
        self.output_processor = OutputProcessor(self.tokenizer, self._eos_token_ids(), self.max_model_len)
        self._sequences: dict[str, Sequence] = {}

    def _max_model_len(self, model_config: ModelConfig, pool_tokens: int) -> int:
        # a lone sequence must always fit in the pool, or preemption could never make room for it
        wanted = self.config.scheduler.max_model_len or model_config.max_position_embeddings
        return min(wanted, pool_tokens)

    def _eos_token_ids(self) -> set[int]:
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return eos

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request the engine cannot serve; changes nothing."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens leaves no room to generate: "
                             f"max_model_len is {self.max_model_len}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        if request_id in self._sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_request(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params, prompt)
        self._sequences[request_id] = seq
        self.output_processor.add(seq)
        self.scheduler.add(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the requests that finished in it."""
        output = self.scheduler.schedule()
        if output.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (pool too small?)")
            return []
        result = self.model_runner.execute_model(output)
        self.scheduler.advance(output)
        finished = []
        for seq_id, token_id, logprob in zip(result.seq_ids, result.sampled.token_ids, result.sampled.logprobs):
            seq = self._sequences[seq_id]
            seq.append_token(token_id, logprob)
            decision = self.output_processor.process_token(seq)
            if decision is not None:
                self.scheduler.finish(seq, decision.finish_reason, decision.stop_reason)
                finished.append(self.output_processor.finish(self._sequences.pop(seq_id)))
        return finished

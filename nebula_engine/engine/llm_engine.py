"""One engine: scheduler + KV pool + model runner + output processing, advanced one step at a time."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import torch

from nebula_engine.config import EngineConfig, ModelConfig
from nebula_engine.engine.admission import ENGINE_DEFAULT, AdmittedRequest, admit
from nebula_engine.engine.kv_cache_builder import KVCache, build_kv_cache
from nebula_engine.engine.kv_plan import ORDINARY, KVPlan
from nebula_engine.engine.model_runner import ModelRunner, latent_attention_backend
from nebula_engine.engine.output_processor import OutputProcessor
from nebula_engine.engine.pic_executor import PICExecutor
from nebula_engine.engine.outputs import RequestOutput
from nebula_engine.engine.parallel_sampling import ParentRequest
from nebula_engine.engine.sampler import Sampler, TopLogprobs
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.scheduler import Scheduler
from nebula_engine.engine.sequence import Sequence
from nebula_engine.engine.structured_outputs import GrammarCompiler
from nebula_engine.engine.tokenizer import Tokenizer
from nebula_engine.kernels.attention import get_attention_backend, resolve_attention_backend
from nebula_engine.kvcache.cache_lock import CacheLock
from nebula_engine.kvcache.pool import num_pages_for_budget
from nebula_engine.model.loader import load_model
from nebula_engine.pic.backends import PICBackend, resolve_pic_backend
from nebula_engine.pic.segments import SegmentedPrompt

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        dtype = getattr(torch, config.dtype)
        model, self.model_config, checkpoint_dir = load_model(config.model, dtype, config.device, config.revision,
                                                              config.quantization)
        # None with skip_tokenizer_init: prompts are token ids and outputs carry token ids only
        self.tokenizer = None if config.skip_tokenizer_init else Tokenizer(config.tokenizer or checkpoint_dir,
                                                                           config.chat_template)
        groups = model.kv_cache_groups(dtype)
        page_size = config.cache.page_size
        # linear-attention layers: one state slot per sequence that can run at once
        num_state_slots = config.scheduler.max_num_seqs if any(not g.is_paged for g in groups) else 0
        num_pages = config.cache.num_pages or num_pages_for_budget(
            groups, page_size, config.cache.kv_cache_memory_bytes, num_state_slots)
        self.max_model_len = self._max_model_len(self.model_config, num_pages * page_size)
        self.pic_backend = resolve_pic_backend(config.pic_backend, model)
        eos_token_ids = self._eos_token_ids()
        self.grammar_compiler = (GrammarCompiler(self.tokenizer.hf, self.model_config.vocab_size, eos_token_ids)
                                 if self.tokenizer is not None else None)
        kv_cache = build_kv_cache(config.cache, groups, num_pages, num_state_slots, config.device, self._model_id(),
                                  with_pic=self.pic_backend is not None)
        self.cache_store = kv_cache.cache_store  # None: prefix caching and PIC both off
        # held by whoever changes the cache; ``step`` lets go of it during its forward passes (``CacheLock``)
        self.cache_lock = CacheLock()
        self.scheduler = Scheduler(config.scheduler, kv_cache.manager, kv_cache.prefix_cache)
        self.model_runner = self._model_runner(model, kv_cache, eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, eos_token_ids, self.max_model_len)
        self._sequences: dict[str, Sequence] = {}
        self._parents: dict[str, ParentRequest] = {}  # n > 1 requests by id
        self._parent_of: dict[str, ParentRequest] = {}  # their sequences' ids -> the request

    def _model_id(self) -> str:
        """Part of every cache key: ``./ckpt`` and ``/abs/ckpt`` (directories or .gguf files) name the same model."""
        source = Path(self.config.model).expanduser()
        return f"{source.resolve() if source.exists() else self.config.model}:{self.config.dtype}"

    def _model_runner(self, model: torch.nn.Module, kv_cache: KVCache, eos_token_ids: set[int]) -> ModelRunner:
        """The model runner over ``kv_cache``'s storage, with the PIC executor it runs combine prefills with when
        there is a cache store to keep segments in."""
        config = self.config
        attention_backend = get_attention_backend(resolve_attention_backend(config.attention_backend, config.device))
        mla_backend = latent_attention_backend(attention_backend, kv_cache.storage.groups)
        sampler = Sampler(config.seed, config.device, eos_token_ids, self.grammar_compiler)
        pic_executor = None
        if kv_cache.cache_store is not None:
            prefix = self.tokenizer.prompt_prefix_ids if self.tokenizer is not None else []
            pic_executor = PICExecutor(model, kv_cache.storage, kv_cache.cache_store, attention_backend, mla_backend,
                                       self._model_id(), prefix[0] if len(prefix) == 1 else None, self.cache_lock)
        return ModelRunner(model, kv_cache.storage, attention_backend, mla_backend, sampler, config.device,
                           pic_executor, self.cache_lock)

    def _max_model_len(self, model_config: ModelConfig, pool_tokens: int) -> int:
        # a lone sequence must always fit in the pool, or preemption could never make room for it
        wanted = self.config.scheduler.max_model_len or model_config.max_position_embeddings
        return min(wanted, pool_tokens)

    def _eos_token_ids(self) -> set[int]:
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return eos

    def add_request(self, request_id: str, prompt_token_ids: list[int] | SegmentedPrompt, params: SamplingParams,
                    prompt: str | None = None, pic_backend: str | None = ENGINE_DEFAULT,
                    kv_plan: KVPlan = ORDINARY) -> None:
        """Admit (``admission.admit``) and queue a request. A ``SegmentedPrompt`` (``tokenizer.segment_prompt`` /
        ``segment_chat``) marks its PIC segments; ``pic_backend`` overrides the engine's for this request (None: no
        PIC, same token ids). ``kv_plan``: see ``add_admitted``."""
        self.add_admitted(request_id, admit(self, prompt_token_ids, params, pic_backend, prompt), kv_plan)

    def add_admitted(self, request_id: str, request: AdmittedRequest, kv_plan: KVPlan = ORDINARY) -> None:
        """Queue a request admitted for this engine; it is not checked again. ``kv_plan`` (``engine.kv_plan``):
        whether its pages are held after it finishes, whether it waits for a gate, whether it only prefills."""
        if request_id in self._sequences or request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if kv_plan.prefill_only and (request.segmented is not None or request.params.n > 1):
            raise ValueError("prefill_only takes a plain token-id prompt with n = 1")
        if request.params.n > 1:
            self._add_parent(request_id, request, kv_plan)
            return
        self._add_sequence(request_id, request, request.params, kv_plan)

    def _add_parent(self, request_id: str, request: AdmittedRequest, kv_plan: KVPlan) -> None:
        if kv_plan.hold:
            raise ValueError("n > 1 cannot hold its pages for a prefill -> decode hand-off")
        parent = ParentRequest(request_id, request.params.n)
        taken = [c for c in parent.child_ids if c in self._sequences or c in self._parents]
        if taken:
            raise ValueError(f"request id {taken[0]!r} of completion {parent.index_of(taken[0])} is already in use")
        self._parents[request_id] = parent
        for index, child_id in enumerate(parent.child_ids):
            self._parent_of[child_id] = parent
            self._add_sequence(child_id, request, request.params.for_completion(index), kv_plan)

    def _add_sequence(self, request_id: str, request: AdmittedRequest, params: SamplingParams,
                      kv_plan: KVPlan) -> None:
        backend = request.backend if request.segmented is not None else None  # it combines PIC segments only
        seq = Sequence(request_id, request.token_ids, params, request.text, request.segmented, backend)
        seq.kv_plan = kv_plan
        self._sequences[request_id] = seq
        self.output_processor.add(seq)
        self.scheduler.add(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_schedulable_requests(self) -> bool:
        """A step would do something: unfinished requests other than those waiting for their KV gate."""
        return self.scheduler.has_schedulable()

    def reset_prefix_cache(self) -> bool:
        """Empty the device's prefix cache and PIC store (vLLM's ``reset_prefix_cache``): every entry leaves the
        device, moved to a host or disk tier when the engine has one (as under pool pressure), else dropped.
        False, changing nothing, while requests are in flight (their pages pin entries)."""
        if self.scheduler.has_unfinished() or self.scheduler.held:
            return False
        if self.cache_store is not None:
            self.cache_store.evict_all()
        return True

    def resolve_request_backend(self, spec: str | None) -> PICBackend | None:
        """The backend a request's spec names (``ENGINE_DEFAULT``: the engine's); ValueError if unusable."""
        if spec == ENGINE_DEFAULT:
            return self.pic_backend
        backend = resolve_pic_backend(spec, self.model_runner.model)
        if backend is not None and self.model_runner.pic_executor is None:
            raise ValueError("this engine runs without a cache store (prefix caching and PIC both off): "
                             "it cannot serve a PIC backend")
        return backend

    def segment_key(self, spec: str | None, token_ids, context_ids=()) -> str:
        """The PIC store key of a segment for a request whose backend spec is ``spec`` (``ENGINE_DEFAULT``: the
        engine's), prefilled behind ``context_ids`` (``segment_context``; a key depends on it only for a backend
        with ``context="prefix"``); "" when that request runs without PIC. Router and workers name store entries
        with this."""
        backend = self.resolve_request_backend(spec)
        if backend is None or self.model_runner.pic_executor is None:
            return ""
        return self.model_runner.pic_executor.segment_key(backend, token_ids, context_ids)

    def segment_context(self, spec: str | None, token_ids, pic_segments) -> tuple[int, ...]:
        """What the PIC segments of a request (its ``token_ids`` and ``pic_segments``) whose backend spec is
        ``spec`` are prefilled behind (``PICExecutor.segment_context``); () when that request runs without PIC."""
        backend = self.resolve_request_backend(spec)
        if backend is None or self.model_runner.pic_executor is None:
            return ()
        return self.model_runner.pic_executor.segment_context(backend, token_ids, pic_segments)

    # ---- prefill / decode hand-off ----

    def held_block_table(self, request_id: str) -> list[int]:
        """Pages of a finished request whose plan holds them (its prompt K/V, page by page)."""
        if request_id not in self.scheduler.held:
            raise KeyError(f"request {request_id!r} holds no pages")
        return list(self.scheduler.kv_cache.block_tables[request_id])

    def held_linear_state(self, request_id: str) -> dict[str, list[torch.Tensor]]:
        """The linear-attention state after a finished held request's prompt, a CPU copy
        (``KVCacheStorage.linear_state``): what the decode peer continues from along with the pages. Its slot
        stays held with the pages until ``release_held``. Empty for models without linear-attention layers."""
        if request_id not in self.scheduler.held:
            raise KeyError(f"request {request_id!r} holds no pages")
        slot = self.scheduler.kv_cache.state_slot(request_id)
        return {} if slot is None else self.model_runner.kv_storage.linear_state(slot)

    def release_held(self, request_id: str) -> None:
        if request_id in self.scheduler.held:
            self.scheduler.release_held(request_id)

    def reserve_prefilled(self, request_id: str, num_tokens: int) -> list[int]:
        """Pages (and, with linear-attention layers, a state slot) for a request whose first ``num_tokens``
        tokens' K/V another engine computed; the caller writes the pages, then calls ``add_prefilled``.
        OutOfPagesError / OutOfStateSlotsError when the pool is short; ``cancel_prefilled`` frees both."""
        if request_id in self._sequences or request_id in self.scheduler.kv_cache.block_tables:
            raise ValueError(f"request id {request_id!r} is already in use")
        return list(self.scheduler.kv_cache.allocate_slots(request_id, num_tokens))

    def cancel_prefilled(self, request_id: str) -> None:
        if request_id not in self._sequences and request_id in self.scheduler.kv_cache.block_tables:
            self.scheduler.kv_cache.free(request_id)

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token: int, first_logprob: float,
                      params: SamplingParams, cached: tuple[int, ...] = (0, 0, 0),
                      linear_state: Mapping[str, list[torch.Tensor]] | None = None) -> RequestOutput:
        """Continue a request prefilled elsewhere: its prompt K/V is in the reserved pages, its first token was
        sampled there. Returns the output after that first token (it may already be finished). ``cached``: the
        prefix, PIC and recomputed token counts, then optionally the cache hits (default: prefix + PIC).
        ``linear_state``: with linear-attention layers (required then), the state after the prompt
        (``held_linear_state`` on the prefill engine); it is loaded into the reserved state slot."""
        if params.n > 1 or params.prompt_logprobs is not None:
            raise ValueError("a request prefilled by another engine runs one completion (n=1) without prompt_logprobs")
        self._load_prefilled_state(request_id, linear_state)
        seq = Sequence(request_id, prompt_token_ids, params)
        seq.num_prefix_cached_tokens, seq.num_pic_cached_tokens, seq.num_recomputed_tokens = cached[:3]
        hits = cached[3] if len(cached) > 3 else cached[0] + cached[1]
        seq.num_pic_hit_tokens = hits - seq.num_prefix_cached_tokens
        if any(cached[:3]):  # reused K/V of a provenance this engine cannot check: never cache its pages
            seq.num_exact_kv_tokens = 0
        seq.num_computed_tokens = len(prompt_token_ids)
        self._sequences[request_id] = seq
        self.output_processor.add(seq)
        self.scheduler.add_running(seq)
        seq.append_token(first_token, first_logprob)
        decision = self.output_processor.process_token(seq)
        if decision is not None:
            self.scheduler.finish(seq, decision.finish_reason, decision.stop_reason)
            return self.output_processor.finish(self._sequences.pop(request_id))
        return self.output_processor.snapshot(seq)

    def _load_prefilled_state(self, request_id: str, linear_state: Mapping[str, list[torch.Tensor]] | None) -> None:
        if request_id not in self.scheduler.kv_cache.block_tables:
            raise ValueError(f"request {request_id!r} has no reserved pages (reserve_prefilled)")
        slot = self.scheduler.kv_cache.state_slot(request_id)
        if slot is None:
            return
        if not linear_state:
            raise ValueError("a model with linear-attention layers continues a prefilled request only from the "
                             "linear-attention state after its prompt")
        self.model_runner.kv_storage.load_linear_state(slot, linear_state)

    def abort_request(self, request_id: str) -> bool:
        """Stop ``request_id`` now; False if it is unknown or already finished."""
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            for child_id in parent.child_ids:
                self._parent_of.pop(child_id, None)
                self.abort_request(child_id)
            return True
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(seq)
        self.output_processor.discard(request_id)
        return True

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns a ``RequestOutput`` (cumulative so far) for every request that
        got a token in it, ``finished`` set on those that stopped. A request whose own work failed in this step
        (``ModelRunnerOutput.failed``, or its output processing) is aborted and returned finished with ``error``
        set; the others go on. An exception out of ``step`` is the engine's, not one request's. Holds
        ``cache_lock`` except during its forward passes (the batch's, a PIC combine's, a segment prefill's)."""
        with self.cache_lock:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        output = self.scheduler.schedule()
        if output.is_empty:
            if self.scheduler.has_schedulable():  # (requests waiting for their KV gate only: nothing to do yet)
                raise RuntimeError("scheduler made no progress with requests pending (pool too small?)")
            return []
        result = self.model_runner.execute_model(output)
        self.scheduler.advance(output, failed=result.failed)
        outputs = [self._fail(seq_id, exc) for seq_id, exc in result.failed.items()]
        outputs += [self._finish_prefilled(entry.seq) for entry in output.scheduled
                    if entry.seq.kv_plan.prefill_only and entry.seq_id not in result.failed
                    and entry.seq.num_computed_tokens == entry.seq.num_tokens]
        for seq_id, (first, entries) in result.prompt_logprobs.items():
            if seq_id in self._sequences:  # not failed in this step's sampling
                self.output_processor.add_prompt_logprobs(self._sequences[seq_id], first, entries)
        sampled = result.sampled
        tops = sampled.top_logprobs or [None] * len(result.seq_ids)
        for seq_id, token_id, logprob, top in zip(result.seq_ids, sampled.token_ids, sampled.logprobs, tops):
            seq = self._sequences.get(seq_id)
            if seq is None:  # a sibling of an n > 1 request failed earlier in this step: it was aborted with it
                continue
            try:
                outputs.append(self._append_token(seq, token_id, logprob, top))
            except Exception as exc:  # this request's detokenization or stop check
                logger.error("request %s failed while processing its output", seq_id, exc_info=exc)
                outputs.append(self._fail(seq_id, exc))
        return self._gather_parents(outputs)

    def _gather_parents(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs of the sequences of ``n > 1`` requests become one output per request (after the others)."""
        gathered, touched = [], {}
        for output in outputs:
            parent = self._parent_of.get(output.request_id)
            if parent is None:
                gathered.append(output)
                continue
            parent.update(output.request_id, output)
            touched[parent.request_id] = parent
        for parent in touched.values():
            if parent.error is not None:  # one completion failed: the request fails, its other sequences stop
                for child_id in parent.unfinished_child_ids():
                    self.abort_request(child_id)
            if parent.finished:
                self._parents.pop(parent.request_id, None)
                for child_id in parent.child_ids:
                    self._parent_of.pop(child_id, None)
            gathered.append(parent.output())
        return gathered

    def _append_token(self, seq: Sequence, token_id: int, logprob: float,
                      top: TopLogprobs | None = None) -> RequestOutput:
        seq.append_token(token_id, logprob)
        decision = self.output_processor.process_token(seq, top)
        if decision is None:
            return self.output_processor.snapshot(seq)
        self.scheduler.finish(seq, decision.finish_reason, decision.stop_reason)
        return self.output_processor.finish(self._sequences.pop(seq.seq_id))

    def _finish_prefilled(self, seq: Sequence) -> RequestOutput:
        """A sequence whose plan is ``prefill_only``, its prompt computed: finished with no token, as if
        ``max_tokens`` were 0 ("length")."""
        self.scheduler.finish(seq, "length")
        return self.output_processor.finish(self._sequences.pop(seq.seq_id))

    def _fail(self, seq_id: str, exc: Exception) -> RequestOutput:
        """Abort ``seq_id`` (its pages go back to the pool) and return its finished output with the error."""
        seq = self._sequences.pop(seq_id)
        self.scheduler.abort(seq)
        seq.finish_reason = "error"
        output = self.output_processor.finish(seq)
        output.error = f"the engine failed this request ({type(exc).__name__}: {exc})"
        return output

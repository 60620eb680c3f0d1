"""One request's token state as the scheduler and model runner see it."""

from __future__ import annotations

import enum
import sys
import time

from nebula_engine.engine.kv_plan import ORDINARY, KVPlan
from nebula_engine.engine.outputs import RequestTimes
from nebula_engine.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt + generated tokens; ``num_computed_tokens`` of them have K/V in the cache."""

    def __init__(self, seq_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 prompt: str | None = None, segmented=None, pic_backend=None, arrival_time: float | None = None):
        """``arrival_time``: ``time.monotonic()`` when it reached the engine (default: now)."""
        self.seq_id = seq_id
        self.segmented = segmented  # SegmentedPrompt with PIC segments, or None
        self.pic_backend = pic_backend  # PICBackend that combines them, or None (plain prefill)
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.num_computed_tokens = 0
        self.num_prefix_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.num_pic_cached_tokens = 0  # prompt tokens taken from the PIC store (combine prefill)
        self.num_recomputed_tokens = 0  # of those, the ones the PIC backend recomputed
        self.num_exact_kv_tokens = sys.maxsize  # its K/V is exact before this token (a combine may approximate)
        # of num_pic_cached_tokens, those whose KV existed before this request (not prefilled for it): cache hits
        self.num_pic_hit_tokens = 0
        self.status = SequenceStatus.WAITING
        self.output_logprobs: list[float] = []  # each sampled token's
        self.output_top_logprobs: list = []  # outputs.Logprob dicts per token, only when params.logprobs is set
        self.prompt_logprobs: list | None = None  # outputs.PromptLogprobs, only when params.prompt_logprobs is set
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # later requests admitted while it waited (a PIC prompt may be passed; the scheduler bounds how often)
        self.num_times_passed = 0
        self.kv_plan: KVPlan = ORDINARY  # held pages, a KV gate, prefill only (``engine.kv_plan``)
        # time.monotonic() of its arrival, of its first admission by the scheduler, of its first token's forward
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def waits_for_kv(self) -> bool:
        return self.kv_plan.waits_for_kv

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")

    @property
    def needs_combine(self) -> bool:
        """The rest of its prompt is prefilled by a PIC combine: it has PIC segments and part of its prompt is
        not in the cache yet (also after a preemption, so a resumed request keeps its PIC K/V). Not when it asks
        for prompt logprobs, which are those of the exact full prefill."""
        return (self.pic_backend is not None and self.segmented is not None
                and bool(self.segmented.pic_segments) and self.sampling_params.prompt_logprobs is None
                and self.num_computed_tokens < self.num_prompt_tokens)

    @property
    def approximate_kv_spec(self) -> str | None:
        """The provenance of approximate K/V this sequence may reuse and make: its PIC backend's spec when it has
        PIC segments to combine; None (exact K/V only) for PIC off and prompts without segments."""
        if self.pic_backend is None or self.segmented is None or not self.segmented.pic_segments:
            return None
        return self.pic_backend.spec

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from KV that existed before this request (the cache hits)."""
        return self.num_prefix_cached_tokens + self.num_pic_hit_tokens

    @property
    def times(self) -> RequestTimes | None:
        """Its queue and prefill times, once it has a first token."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return RequestTimes(self.first_scheduled_time - self.arrival_time,
                            self.first_token_time - self.first_scheduled_time)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)

    def reset_for_recompute(self) -> None:
        """Preempted: its pages are gone, so every token (prompt and output) is prefilled again: after what the
        prefix cache still holds, a PIC prompt by a combine, the output tokens by plain prefill."""
        self.num_computed_tokens = 0
        self.num_exact_kv_tokens = sys.maxsize  # set again by what it matches and by its combine
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

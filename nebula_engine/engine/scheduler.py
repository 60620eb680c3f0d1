"""Continuous batching with chunked prefill and recompute preemption. Pure policy: no tensors.

Each step spends a budget of ``max_num_batched_tokens`` new tokens: running sequences first (a
decode costs one token, an unfinished prefill continues with the next chunk), then waiting
sequences in arrival order. A PIC prompt's combine is not chunked; one that does not fit the leftover
budget is passed by later sequences, a bounded number of times (``_schedule_waiting``). When the pool
runs out of pages, the newest running sequence is preempted: its pages are freed and it re-enters the
front of the queue to be recomputed (a PIC prompt by a combine again, its segments looked up anew).
With prefix caching, a sequence is admitted after its longest cached prefix (never its last token)
and its pages are cached as they fill; unlocked cached pages are evicted before anyone is preempted.
Each sequence is stamped, by the clock the scheduler is given, when it is first scheduled and when its first
token's forward has run (its queue and prefill times).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Collection

from nebula_engine.config import SchedulerConfig
from nebula_engine.engine.sequence import Sequence, SequenceStatus
from nebula_engine.kvcache.pool import KVCacheManager, OutOfPagesError
from nebula_engine.kvcache.prefix_caching import PrefixCachingKVCacheManager


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_computed_tokens: int  # tokens already in the cache when this step starts
    num_new_tokens: int
    block_table: list[int]  # the sequence's pages; read-only, valid for this step
    samples: bool  # this step reaches the last known token, so the next one is sampled (never: prefill_only)
    state_slot: int | None = None  # linear-attention state slot (models with linear-attention layers only)

    @property
    def seq_id(self) -> str:
        return self.seq.seq_id


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...]
    preempted_seq_ids: tuple[str, ...]
    finished_seq_ids: tuple[str, ...]  # finished since the previous step: drop per-request state
    # the rest of a PIC prompt, each prefilled by its own combine; it samples unless the sequence was preempted
    # after sampling (then its output tokens are prefilled in the next steps)
    combines: tuple[ScheduledSequence, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.combines

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled + self.combines)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 prefix_cache: PrefixCachingKVCacheManager | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """``prefix_cache``: ``kv_cache`` again when sequences match and cache their prefixes in it; None: prefix
        caching is off (a ``PrefixCachingKVCacheManager`` may still serve the PIC store alone). ``clock``: the
        sequences' ``arrival_time`` clock, for their first-scheduled and first-token stamps."""
        if prefix_cache is not None and prefix_cache is not kv_cache:
            raise ValueError("prefix_cache must be kv_cache itself: both hand out the same block tables")
        self.config = config
        self.kv_cache = kv_cache
        self.prefix_cache = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._finished_seq_ids: list[str] = []
        self.held: set[str] = set()  # finished sequences whose pages stay allocated until released
        self.clock = clock

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the pool's pages held by sequences (cached pages nobody holds can be evicted: free)."""
        return 1.0 - self.kv_cache.num_free_pages / self.kv_cache.pool.num_pages

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_schedulable(self) -> bool:
        """Something a step can do: a running sequence, or a waiting one whose KV gate is open."""
        return bool(self.running) or any(not seq.waits_for_kv for seq in self.waiting)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        combines: list[ScheduledSequence] = []
        preempted: list[str] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled, combines)
        finished, self._finished_seq_ids = tuple(self._finished_seq_ids), []
        return SchedulerOutput(tuple(scheduled), tuple(preempted), finished, tuple(combines))

    def _schedule_running(self, budget: int, scheduled: list, preempted: list) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = self._chunk(seq, budget)
            if not self._allocate_or_preempt(seq, num_new, preempted):
                break
            scheduled.append(self._entry(seq, num_new))
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, preempted: list) -> bool:
        """Find pages for ``seq`` by preempting the newest running sequences; False if ``seq`` itself went."""
        while True:
            try:
                self.kv_cache.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new)
                return True
            except OutOfPagesError:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache.free(seq.seq_id)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def _schedule_waiting(self, budget: int, scheduled: list, combines: list) -> None:
        """Admit waiting sequences in order. A PIC prompt is not chunked: its combine prefill needs the rest of the
        prompt at once. When that does not fit the step's leftover budget it keeps its place and later sequences
        are admitted past it, but at most ``max_num_seqs`` of them: then nobody passes it, the running set drains
        and it gets a step's budget (or runs alone when it exceeds the budget). A sequence whose KV gate is shut
        keeps its place too, and passing it is not counted."""
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[index]
            if seq.waits_for_kv:
                index += 1
                continue
            if self._waits_for_cache_io(seq, scheduled):
                break
            self._match_prefix(seq)
            combine = seq.needs_combine
            # a combine prefills the prompt only; a resumed request's output tokens follow by plain prefill
            remaining = (seq.num_prompt_tokens if combine else seq.num_tokens) - seq.num_computed_tokens
            if combine and remaining > budget and (scheduled or combines):
                self._undo_match(seq)
                if seq.num_times_passed >= self.config.max_num_seqs:
                    break
                index += 1
                continue
            num_new = remaining if combine else self._chunk(seq, budget)
            # a resumed combine takes its output tokens' pages too: they are prefilled in the next step, and
            # taking fewer would let it be admitted only to be preempted again
            num_slots = seq.num_tokens if combine else seq.num_computed_tokens + num_new
            if not self.kv_cache.can_allocate(seq.seq_id, num_slots):
                self._undo_match(seq)  # a waiting sequence holds no pages, so it cannot pin the cache
                break
            self.kv_cache.allocate_slots(seq.seq_id, num_slots)
            del self.waiting[index]
            for passed in itertools.islice(self.waiting, index):
                if not passed.waits_for_kv:
                    passed.num_times_passed += 1
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = self.clock()
            self.running.append(seq)
            (combines if combine else scheduled).append(self._entry(seq, num_new))
            budget -= num_new

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """New tokens of ``seq`` this step: what is left, within the budget, ending at its state checkpoint if it
        has one ahead (hybrid models cache their linear-attention state there, ``prefix_caching``)."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        checkpoint = self.kv_cache.state_checkpoint(seq.seq_id)
        if checkpoint > seq.num_computed_tokens:
            num_new = min(num_new, checkpoint - seq.num_computed_tokens)
        return num_new

    def _waits_for_cache_io(self, seq: Sequence, scheduled: list) -> bool:
        """``seq``'s cached prefix is still loading from disk while other sequences can run: admitting
        it now would block the step on that read."""
        if self.prefix_cache is None or not (self.running or scheduled):
            return False
        return self.prefix_cache.loading(seq.token_ids)

    def _match_prefix(self, seq: Sequence) -> None:
        """Start ``seq`` after its longest cached prefix (its pages are shared, not recomputed)."""
        if self.prefix_cache is None:
            return
        # prompt logprobs need every prompt token's hidden state: match nothing (vLLM skips the cache alike)
        # a hybrid model's combine (HYPIC) starts from position 0: match nothing for it either
        match_nothing = (seq.sampling_params.prompt_logprobs is not None
                         or (seq.needs_combine and self.kv_cache.state_slots is not None))
        wanted = seq.token_ids[:1] if match_nothing else seq.token_ids
        seq.num_computed_tokens = self.prefix_cache.match_prefix(seq.seq_id, wanted, seq.approximate_kv_spec or "")
        if seq.num_preemptions == 0:
            seq.num_prefix_cached_tokens = seq.num_computed_tokens

    def _undo_match(self, seq: Sequence) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.free(seq.seq_id)
            seq.num_computed_tokens = 0

    def _entry(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        samples = seq.num_computed_tokens + num_new == seq.num_tokens and not seq.kv_plan.prefill_only
        return ScheduledSequence(seq, seq.num_computed_tokens, num_new, self.kv_cache.block_tables[seq.seq_id], samples,
                                 self.kv_cache.state_slot(seq.seq_id))

    def advance(self, output: SchedulerOutput, failed: Collection[str] = ()) -> None:
        """The model ran ``output``: its new tokens now have K/V in the cache, except for the ``failed`` sequences
        (their pages are never cached; the engine aborts them)."""
        now = self.clock()
        for entry in output.scheduled + output.combines:
            if entry.seq_id in failed:
                continue
            if entry.samples and entry.seq.first_token_time is None:
                entry.seq.first_token_time = now
            entry.seq.num_computed_tokens += entry.num_new_tokens
            if self.prefix_cache is not None:  # full pages become reusable as soon as they are computed
                self.prefix_cache.cache_pages(entry.seq_id, entry.seq.token_ids, entry.seq.num_computed_tokens,
                                              entry.seq.num_exact_kv_tokens)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is; its pages go back to the pool (cached ones stay cached)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.kv_cache.free(seq.seq_id)
            self._finished_seq_ids.append(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.running.remove(seq)
        if seq.kv_plan.hold:  # another engine reads its pages first (prefill -> decode hand-off)
            self.held.add(seq.seq_id)
        else:
            self.kv_cache.free(seq.seq_id)
        self._finished_seq_ids.append(seq.seq_id)

    def release_held(self, seq_id: str) -> None:
        self.held.remove(seq_id)
        self.kv_cache.free(seq_id)

    def add_running(self, seq: Sequence) -> None:
        """``seq`` arrives with its prompt K/V already in its pages (``kv_cache.block_tables``): it decodes next."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

"""Discrete-event simulator of N prefill workers and one decode worker, driven by the real
control plane (view, cache manager, policy/planner) through worker events delivered after a delay.

Each prefill worker runs one job at a time from a FIFO; combine prefills whose KV is ready go ahead
of queued scatter prefills (§7.2). Prefill time and transfer time come from the profile. Requests
arrive as a Poisson process at ``qps`` in the trace's original order. Deterministic for a seed.

Simplifications: TTFT ends when the request's KV reaches the decode worker (one output token, so
decode compute is not modelled); transfers do not contend for links; only the device tier is
simulated (the planner's slow-tier rule is exercised by unit tests); a reused copy is read at
dispatch, so an eviction after dispatch does not invalidate it.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from nebula_engine.cluster.config import ClusterConfig
from nebula_engine.cluster.control_plane import ControlPlane
from nebula_engine.cluster.messages import (Action, CacheKind, DoneEvent, EvictEvent, PrefillPlan,
                                            StoreEvent)
from nebula_engine.cluster.policies import CACHES
from nebula_engine.cluster.request_keys import RequestKeys
from nebula_engine.cluster.sim_report import Counters, SimulationReport
from nebula_engine.cluster.worker_cache import WorkerCache
from nebula_engine.workloads.request import Request


@dataclass(frozen=True)
class SimulationConfig:
    cluster: ClusterConfig = ClusterConfig()
    policy: str = "nebula"
    view: str | None = None  # None: the policy's default (event-driven for the Dynamo baselines)
    cache: str = "self-tuning"
    scheduler: str = "greedy"
    qps: float = 8.0
    ttft_slo_s: float = 1.0
    warmup_requests: int = 0


@dataclass
class Job:
    seconds: float
    kv_tokens: int  # KV the job holds in the worker's pool while it runs
    on_done: Callable[[float], None]


@dataclass
class WorkerQueue:
    scatter: deque = field(default_factory=deque)
    combine: deque = field(default_factory=deque)
    busy: bool = False


@dataclass
class RequestState:
    keys: RequestKeys
    plan: PrefillPlan
    arrival: float
    measured: bool
    pending: int = 1  # inputs not yet ready; starts at 1 so dispatch itself holds it open
    ready_at: float = 0.0
    combine_work: float = 0.0


class Simulator:
    def __init__(self, config: SimulationConfig, requests: Sequence[Request]):
        if config.cache not in CACHES:
            raise ValueError(f"unknown cache {config.cache!r}; choose from {sorted(CACHES)}")
        cluster = config.cluster
        self.config, self.cluster, self.profile = config, cluster, cluster.profile
        self.requests = list(requests)
        self.control = ControlPlane(cluster, config.policy, config.view, config.scheduler)
        self.self_tuning = config.cache == "self-tuning"
        n = cluster.num_prefill_workers
        self.caches = [WorkerCache(self.profile.cache_capacity_tokens, CACHES[config.cache],
                                   cluster.cache_manager.initial_pc_share) for _ in range(n)]
        self.queues = [WorkerQueue() for _ in range(n)]
        self.producing: dict[tuple[int, CacheKind, str], list[Callable[[float], None]]] = {}
        self.seq = [itertools.count() for _ in range(n)]
        self.heap: list = []
        self.tick = itertools.count()
        self.counters = Counters(computed_tokens=[0.0] * n)
        self.ttfts: list[float] = []
        self.last_completion = 0.0
        self._measured_start = 0.0

    # ---- event loop ---------------------------------------------------------------------------
    def at(self, time: float, action: Callable[[float], None]) -> None:
        heapq.heappush(self.heap, (time, next(self.tick), action))

    def run(self) -> SimulationReport:
        rng = random.Random(self.cluster.seed)
        arrival = 0.0
        for index, request in enumerate(self.requests):
            arrival += rng.expovariate(self.config.qps)
            self.at(arrival, lambda now, r=request, i=index: self._arrive(r, i, now))
        while self.heap:
            time, _, action = heapq.heappop(self.heap)
            action(time)
        return self._report(self._measured_start)

    def _report(self, first_measured: float) -> SimulationReport:
        config = self.config
        settings = dict(policy=config.policy, view=self.control.view_name, cache=config.cache,
                        scheduler=config.scheduler if config.policy == "nebula" else "-", qps=config.qps)
        return SimulationReport.build(settings, self.ttfts, self.counters,
                                      self.last_completion - first_measured, config.ttft_slo_s,
                                      self.control.cache_manager.history)

    # ---- router side --------------------------------------------------------------------------
    def _arrive(self, request: Request, index: int, now: float) -> None:
        keys = RequestKeys.of(request)
        measured = index >= self.config.warmup_requests
        if index == self.config.warmup_requests:
            self._measured_start = now
        decision = self.control.on_request(keys, now)
        if decision.pc_share is not None and self.self_tuning:
            for cache in self.caches:
                cache.pc_share = decision.pc_share
        state = RequestState(keys, decision.plan, now, measured, ready_at=now)
        if measured:
            self.counters.input_tokens += keys.total_tokens
        self._dispatch(state, now)

    def _emit(self, worker: int, make_event: Callable[[int], object], now: float) -> None:
        event = make_event(next(self.seq[worker]))
        self.at(now + self.cluster.event_delay_s, lambda t, e=event: self.control.on_event(e, t))

    # ---- dispatch of one plan -----------------------------------------------------------------
    def _dispatch(self, state: RequestState, now: float) -> None:
        plan, keys = state.plan, state.keys
        valid_depth = self._use_prefix(state, now)
        planned = {s.index for s in plan.segments}
        state.combine_work = sum(t for i, t in enumerate(keys.tokens)
                                 if i >= valid_depth and i not in planned)
        for segment in plan.segments:
            state.combine_work += self.profile.pic_recompute_ratio * segment.num_tokens
            if segment.action is Action.COMPUTE:
                self._compute(state, segment.index, segment.worker, segment.task_id, now)
            elif segment.action is Action.REUSE:
                self._reuse(state, segment.index, segment.worker, now)
            else:
                self._local(state, segment.index, now)
        for key in plan.pc_keys:
            self.producing.setdefault((plan.combine_home, CacheKind.PC, key), [])
        self._input_ready(state, now)

    def _use_prefix(self, state: RequestState, now: float) -> int:
        """Wait for (or move) the planned prefix; returns how many segments it really covers."""
        prefix, keys = state.plan.prefix, state.keys
        if prefix is None:
            return 0
        cache, depth = self.caches[prefix.worker], 0
        for depth in range(prefix.num_segments):
            key = keys.pc_keys[depth]
            if not cache.has(CacheKind.PC, key) and not self._is_producing(prefix.worker, CacheKind.PC, key):
                break
        else:
            depth = prefix.num_segments
        planned_tokens = keys.prefix_tokens(prefix.num_segments)
        self._count(state, "invalid_hit_tokens", planned_tokens - keys.prefix_tokens(depth))
        self._count(state, "hit_tokens", keys.prefix_tokens(depth))
        for key in reversed(keys.pc_keys[:depth]):
            cache.touch(CacheKind.PC, key)
        pending = [k for k in keys.pc_keys[:depth] if not cache.has(CacheKind.PC, k)]
        tokens = keys.prefix_tokens(depth)
        for key in pending[:-1]:  # chain entries still being computed: wait for all, move once
            self._wait(state, prefix.worker, CacheKind.PC, key, 0)
        if pending:
            self._wait(state, prefix.worker, CacheKind.PC, pending[-1], tokens)
        elif depth:
            self._arrive_at_home(state, prefix.worker, tokens, now)
        return depth

    def _compute(self, state: RequestState, index: int, worker: int, task_id: str, now: float) -> None:
        key, tokens = state.keys.content_ids[index], state.keys.tokens[index]
        if any(self._is_producing(w, CacheKind.PIC, key) for w in range(len(self.caches))):
            self._count(state, "repeated_tokens", tokens)  # a directory miss on in-flight work
        self._scatter(state, worker, key, tokens, task_id, now)

    def _reuse(self, state: RequestState, index: int, worker: int, now: float) -> None:
        key, tokens = state.keys.content_ids[index], state.keys.tokens[index]
        if self.caches[worker].has(CacheKind.PIC, key):
            self.caches[worker].touch(CacheKind.PIC, key)
            self._count(state, "hit_tokens", tokens)
            self._arrive_at_home(state, worker, tokens, now)
        elif self._is_producing(worker, CacheKind.PIC, key):
            self._count(state, "hit_tokens", tokens)
            self._wait(state, worker, CacheKind.PIC, key, tokens)
        else:  # neither cached nor in flight there: the home recomputes it in the combine prefill
            self._count(state, "invalid_hit_tokens", tokens)
            state.combine_work += tokens

    def _local(self, state: RequestState, index: int, now: float) -> None:
        home = state.plan.combine_home
        key, tokens = state.keys.content_ids[index], state.keys.tokens[index]
        if self.caches[home].has(CacheKind.PIC, key) or self._is_producing(home, CacheKind.PIC, key):
            self._reuse(state, index, home, now)
        else:
            self._scatter(state, home, key, tokens, "", now)

    # ---- data movement ------------------------------------------------------------------------
    def _is_producing(self, worker: int, kind: CacheKind, key: str) -> bool:
        return (worker, kind, key) in self.producing

    def _wait(self, state: RequestState, worker: int, kind: CacheKind, key: str, tokens: int) -> None:
        state.pending += 1
        self.producing[(worker, kind, key)].append(
            lambda t: self._arrive_at_home(state, worker, tokens, t, counted=True))

    def _arrive_at_home(self, state: RequestState, src: int, tokens: int, now: float,
                        counted: bool = False) -> None:
        """KV of ``tokens`` tokens is ready on ``src`` at ``now``; it reaches the home after the move."""
        home = state.plan.combine_home
        if src != home:
            self._count(state, "transferred_bytes", tokens * self.profile.kv_bytes_per_token)
        if not counted:
            state.pending += 1
        self._input_ready(state, now + self.profile.transfer_seconds(src, home, tokens))

    def _scatter(self, state: RequestState, worker: int, key: str, tokens: int, task_id: str,
                 now: float) -> None:
        producer = (worker, CacheKind.PIC, key)
        self.producing.setdefault(producer, [])
        self._wait(state, worker, CacheKind.PIC, key, tokens)

        def done(t: float) -> None:
            self._store(worker, CacheKind.PIC, [(key, tokens)], t)
            if task_id:
                self._emit(worker, lambda s: DoneEvent(worker, s, task_id), t)

        self._count(state, "computed", tokens, worker)
        self._enqueue(worker, Job(self.profile.prefill.seconds(tokens), tokens, done), combine=False, now=now)

    def _store(self, worker: int, kind: CacheKind, entries: list[tuple[str, int]], now: float) -> None:
        cache = self.caches[worker]
        for key, tokens in entries:
            stored, evicted = cache.store(kind, key, tokens)
            if stored:
                self._emit(worker, lambda s, k=key, n=tokens: StoreEvent(worker, s, kind, k, n), now)
            self._emit_evictions(worker, evicted, now)
        for key, _ in entries:
            for waiter in self.producing.pop((worker, kind, key), []):
                waiter(now)

    def _emit_evictions(self, worker: int, evicted: list[tuple[CacheKind, str]], now: float) -> None:
        for kind, key in evicted:
            self._emit(worker, lambda s, k=kind, v=key: EvictEvent(worker, s, k, v), now)

    # ---- combine and completion ---------------------------------------------------------------
    def _input_ready(self, state: RequestState, ready_at: float) -> None:
        state.ready_at = max(state.ready_at, ready_at)
        state.pending -= 1
        if state.pending == 0:
            self.at(state.ready_at, lambda t: self._start_combine(state, t))

    def _start_combine(self, state: RequestState, now: float) -> None:
        home, keys = state.plan.combine_home, state.keys
        work = state.combine_work
        seconds = self.profile.prefill.seconds(work, keys.total_tokens - work)
        self._count(state, "computed", work, home)

        def done(t: float) -> None:
            self._store(home, CacheKind.PC, list(zip(reversed(keys.pc_keys), reversed(keys.tokens))), t)
            self._emit(home, lambda s: DoneEvent(home, s, state.plan.combine_task_id), t)
            decode = self.cluster.decode_worker
            first_token = t + self.profile.transfer_seconds(home, decode, keys.total_tokens)
            self.last_completion = max(self.last_completion, first_token)
            if state.measured:
                self.ttfts.append(first_token - state.arrival)

        self._enqueue(home, Job(seconds, keys.total_tokens, done), combine=True, now=now)

    def _enqueue(self, worker: int, job: Job, combine: bool, now: float) -> None:
        queue = self.queues[worker]
        (queue.combine if combine else queue.scatter).append(job)
        if not queue.busy:
            self._start_next(worker, now)

    def _start_next(self, worker: int, now: float) -> None:
        queue = self.queues[worker]
        if not queue.combine and not queue.scatter:
            queue.busy = False
            return
        job = queue.combine.popleft() if queue.combine else queue.scatter.popleft()
        queue.busy = True
        self._emit_evictions(worker, self.caches[worker].pin(job.kv_tokens), now)

        def finish(t: float) -> None:
            self.caches[worker].unpin(job.kv_tokens)
            job.on_done(t)
            self._start_next(worker, t)

        self.at(now + job.seconds, finish)

    def _count(self, state: RequestState, counter: str, amount: float, worker: int | None = None) -> None:
        if not state.measured:
            return
        if counter == "computed":
            self.counters.computed_tokens[worker] += amount
        else:
            setattr(self.counters, counter, getattr(self.counters, counter) + int(amount))


def simulate(config: SimulationConfig, requests: Sequence[Request]) -> SimulationReport:
    return Simulator(config, requests).run()

"""Discrete-event simulator of N prefill workers and one decode worker, driven by the real control plane
(view, cache manager, policy/planner) through worker events delivered after a delay.

The data plane does what the workers do (``cluster/runtime/worker.py`` and the engine under it):
- a scatter task prefills one PIC segment alone on its worker and stores it there (store event), unless
  the worker already holds it (a host copy is promoted first);
- the combine home fetches every remote source: the holder serves it from its device, promotes it from
  its host tier, or waits for its in-flight computation; the KV crosses the link and is stored at the home
  (store event); a source that is gone is recomputed at the home (an invalid hit);
- the home's engine matches the request against its own cache when it admits the combine: the prefix
  chain (device or host), each PIC segment past it; cold PIC segments are prefilled alone inside the
  combine's forward and stored, the rest costs ``ClusterProfile.combine_cost`` per reused PIC token;
  the prompt's prefix chain is stored afterwards; the KV is handed to the decode worker.

Compute: each worker runs batched forwards of at most ``max_batch_tokens`` new tokens, combines first
(a combine is never chunked and runs alone when it exceeds the budget), then scatters (chunked);
workers sharing a machine share its processors. Transfers queue on the ports of their links. The KV of
running requests is pinned in the device pool; evicted entries are demoted to the host tier.

Requests arrive as a Poisson process at ``qps`` in the trace's order (or at given offsets). TTFT ends at
the first token: after the hand-off to the decode worker (SGLang's PD path, the paper's setting) or when
the prefill finishes (this engine's cluster, which streams the first token from the prefill peer).
Deterministic for a seed. Not modelled: decode compute, router CPU time, message latency other than
event delivery and link latency.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from nebula_engine.cluster.control.config import ClusterConfig, ClusterProfile
from nebula_engine.cluster.control.control_plane import ControlPlane
from nebula_engine.cluster.control.messages import Action, CacheKind, DoneEvent, PrefillPlan, Tier
from nebula_engine.cluster.control.policies import CACHES, default_cache
from nebula_engine.cluster.control.request_keys import RequestKeys
from nebula_engine.cluster.sim.hardware import Links, make_processors
from nebula_engine.cluster.sim.report import Counters, SimulationReport
from nebula_engine.cluster.sim.worker_cache import CacheChange, WorkerCache
from nebula_engine.workloads.request import Request


@dataclass(frozen=True)
class SimulationConfig:
    cluster: ClusterConfig = ClusterConfig()
    policy: str = "nebula"
    view: str | None = None  # None: the policy's default (event-driven for the Dynamo baselines)
    cache: str | None = None  # None: the policy's default (plain LRU for the baselines, self-tuning for nebula)
    scheduler: str = "greedy"
    qps: float = 8.0
    ttft_slo_s: float = 1.0
    warmup_requests: int = 0
    ttft_includes_handoff: bool = True
    arrival_offsets: tuple[float, ...] | None = None  # arrival times instead of a Poisson process at qps

    @property
    def cache_name(self) -> str:
        return self.cache or default_cache(self.policy)


@dataclass
class RequestState:
    keys: RequestKeys
    plan: PrefillPlan
    arrival: float
    index: int  # position in arrival order
    measured: bool
    pending: int = 1  # inputs not yet at the home; dispatch itself holds one
    ready_at: float = 0.0
    computed_for_it: set[str] = field(default_factory=set)  # PIC keys scatter-prefilled for this request


@dataclass
class ScatterJob:
    key: str
    tokens: int
    task_id: str
    measured: bool
    done_tokens: int = 0


@dataclass
class CombineWork:
    """What the home's engine does for one request, decided when it admits the combine."""

    sequences: list[tuple[float, float]]  # (new tokens, context) of each forward sequence
    cold: list[tuple[str, int]]  # PIC segments prefilled alone here, then stored
    promoted: list[tuple[CacheKind, str, int]]  # host copies moved to the device before the forward
    hit_tokens: int
    host_tokens: int
    pinned: int  # new KV pages the request holds until its hand-off

    @property
    def tokens(self) -> float:
        return sum(n for n, _ in self.sequences)


@dataclass
class WorkerQueue:
    combines: deque = field(default_factory=deque)
    scatters: deque = field(default_factory=deque)
    busy: bool = False


def check_simulable(profile: ClusterProfile) -> None:
    """ValueError for a profile the simulator cannot model: ``lead_while_waiting`` is a local cluster's engine
    property (it prefills the lead apart from the combine); the simulator simulates the paper's combine (§7.2)."""
    if profile.lead_while_waiting:
        raise ValueError(f"profile {profile.name!r} sets lead_while_waiting, a local cluster's engine property the "
                         f"simulator does not model (it simulates the paper's combine, §7.2)")


class Simulator:
    def __init__(self, config: SimulationConfig, requests: Sequence[Request]):
        if config.cache_name not in CACHES:
            raise ValueError(f"unknown cache {config.cache_name!r}; choose from {sorted(CACHES)}")
        cluster = config.cluster
        check_simulable(cluster.profile)
        self.config, self.cluster, self.profile = config, cluster, cluster.profile
        self.requests = list(requests)
        self.control = ControlPlane(cluster, config.policy, config.view, config.scheduler)
        self.self_tuning = config.cache_name == "self-tuning"
        self.uses_pic = config.policy != "pc"
        n = cluster.num_prefill_workers
        self.caches = [WorkerCache(self.profile.cache_capacity_tokens, CACHES[config.cache_name],
                                   cluster.cache_manager.initial_pc_share, self.profile.host_capacity_tokens)
                       for _ in range(n)]
        self.queues = [WorkerQueue() for _ in range(n)]
        self.processors = make_processors(self.profile, n, self.at)
        self.links = Links(self.profile)
        self.producing: dict[tuple[int, str], list[Callable[[float], None]]] = {}  # (worker, PIC key) -> waiters
        self.producing_pc: dict[tuple[int, str], list[Callable[[float], None]]] = {}  # (home, chain key) -> waiters
        # content id or chain key -> the first request (arrival order) that carried it. A reuse counts as a hit
        # only of what an earlier request brought, as in the reuse analysis: a request admitted late may find
        # what a later one computed meanwhile, which saves it time but is no cache hit
        self.first_seen: dict[str, int] = {}
        self.seq = [itertools.count(1) for _ in range(n)]
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
        for index, (request, arrival) in enumerate(zip(self.requests, self._arrivals())):
            self.at(arrival, lambda now, r=request, i=index: self._arrive(r, i, now))
        while self.heap:
            time, _, action = heapq.heappop(self.heap)
            action(time)
        return self._report(self._measured_start)

    def _arrivals(self) -> list[float]:
        if self.config.arrival_offsets is not None:
            if len(self.config.arrival_offsets) < len(self.requests):
                raise ValueError("fewer arrival offsets than requests")
            return list(self.config.arrival_offsets)
        rng, arrival, times = random.Random(self.cluster.seed), 0.0, []
        for _ in self.requests:
            arrival += rng.expovariate(self.config.qps)
            times.append(arrival)
        return times

    def _report(self, first_measured: float) -> SimulationReport:
        config = self.config
        settings = dict(policy=config.policy, view=self.control.view_name, cache=config.cache_name,
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
        if decision.tier_shares is not None and self.self_tuning:
            for cache in self.caches:
                cache.set_shares(decision.tier_shares)
        state = RequestState(keys, decision.plan, now, index, measured, ready_at=now)
        for key in (*keys.content_ids, *keys.pc_keys):
            self.first_seen.setdefault(key, index)
        if measured:
            self.counters.input_tokens += keys.total_tokens
        self._dispatch(state, now)

    def _emit(self, worker: int, event_of: Callable[[int], object], now: float) -> None:
        event = event_of(next(self.seq[worker]))
        self.at(now + self.cluster.event_delay_s, lambda t, e=event: self.control.on_event(e, t))

    def _apply(self, worker: int, changes: list[CacheChange], now: float) -> None:
        """Report cache changes as the worker does: one event each (a tier move is one event)."""
        for change in changes:
            self._emit(worker, lambda s, c=change: c.event(worker, s), now)

    # ---- dispatch of one plan -----------------------------------------------------------------
    def _dispatch(self, state: RequestState, now: float) -> None:
        plan, home = state.plan, state.plan.combine_home
        if plan.prefix is not None and plan.prefix.worker != home:
            self._fetch_prefix(state, plan.prefix.worker, plan.prefix.num_segments, now)
        for key in plan.pc_keys:
            self.producing_pc.setdefault((home, key), [])
        for segment in plan.segments:
            if segment.action is Action.COMPUTE:  # the home too starts its share at once (§4.2, Alg. 1's P_c)
                self._count_repeat(state, segment.key, segment.num_tokens, segment.worker)
                self.producing.setdefault((segment.worker, segment.key), [])
                state.pending += 1
                self._scatter_task(state, segment.key, segment.num_tokens, segment.worker, segment.task_id, now)
            elif segment.action is Action.REUSE:
                self._reuse(state, segment.key, segment.num_tokens, segment.worker, now)
        self._input_ready(state, now)

    def _count_repeat(self, state: RequestState, key: str, tokens: int, worker: int) -> None:
        """A directory miss on work in flight elsewhere: the segment is prefilled twice."""
        if any((w, key) in self.producing for w in range(len(self.caches)) if w != worker):
            self._count(state, "repeated_tokens", tokens)

    def _reuse(self, state: RequestState, key: str, tokens: int, worker: int, now: float) -> None:
        home = state.plan.combine_home
        if worker != home:
            state.pending += 1
            self._fetch(state, key, tokens, worker, now)
        elif (home, key) in self.producing:
            state.pending += 1
            self.producing[(home, key)].append(lambda t: self._input_ready(state, t))
        elif self.caches[home].tier_of(CacheKind.PIC, key) is None:
            self._count(state, "invalid_hit_tokens", tokens)  # the home recomputes it when it admits the combine

    def _fetch(self, state: RequestState, key: str, tokens: int, src: int, now: float) -> None:
        """Pin ``key`` on ``src`` (one link latency away), then move it to the home and store it there."""
        home = state.plan.combine_home
        asked = now + self.profile.link(src, home).latency_s

        def serve(t: float) -> None:
            self._serve_pin(state, src, key, tokens, t, lambda ready: self._send_home(state, src, key, tokens, ready))

        self.at(asked, serve)

    def _serve_pin(self, state, src: int, key: str, tokens: int, now: float, send: Callable[[float], None]) -> None:
        tier = self.caches[src].tier_of(CacheKind.PIC, key)
        if tier is Tier.DEVICE:
            self.caches[src].touch(CacheKind.PIC, key)
            send(now)
        elif tier is Tier.HOST:
            send(self._promote(src, CacheKind.PIC, key, tokens, now))
        elif (src, key) in self.producing:
            self.producing[(src, key)].append(send)
        else:  # neither cached nor in flight there: the home recomputes it
            self._count(state, "invalid_hit_tokens", tokens)
            self._input_ready(state, now)

    def _promote(self, worker: int, kind: CacheKind, key: str, tokens: int, now: float) -> float:
        """Read a host copy back into the device; returns when it is there."""
        done = self.links.load(worker, self.profile.host_load, tokens * self.profile.kv_bytes_per_token, now)
        self._apply(worker, self.caches[worker].promote(kind, key), now)
        return done

    def _send_home(self, state: RequestState, src: int, key: str, tokens: int, now: float) -> None:
        home = state.plan.combine_home
        num_bytes = tokens * self.profile.kv_bytes_per_token
        self._count(state, "transferred_bytes", num_bytes)
        arrived = self.links.transfer(src, home, num_bytes, now)

        def store(t: float) -> None:
            self._apply(home, self.caches[home].store(CacheKind.PIC, key, tokens), t)
            self._input_ready(state, t)

        self.at(arrived, store)

    def _fetch_prefix(self, state: RequestState, worker: int, depth: int, now: float) -> None:
        """Move the planned prefix chain from its holder to the home: what the holder still has, or is still
        computing (the pin waits for it, as for a PIC segment), at pin time."""
        keys, home = state.keys, state.plan.combine_home
        state.pending += 1

        def serve(t: float) -> None:
            cache, held, waits_for = self.caches[worker], 0, None
            while held < depth:
                key = keys.pc_keys[held]
                if cache.has(CacheKind.PC, key):
                    cache.touch(CacheKind.PC, key)
                elif (worker, key) in self.producing_pc:
                    waits_for = key
                else:
                    break
                held += 1
            self._count(state, "invalid_hit_tokens", keys.prefix_tokens(depth) - keys.prefix_tokens(held))
            if waits_for is None:
                move(t, held)
            else:
                self.producing_pc[(worker, waits_for)].append(lambda ready: move(ready, held))

        def move(t: float, held: int) -> None:
            num_bytes = keys.prefix_tokens(held) * self.profile.kv_bytes_per_token
            self._count(state, "transferred_bytes", num_bytes)
            self.at(self.links.transfer(worker, home, num_bytes, t), lambda end: store(end, held))

        def store(t: float, held: int) -> None:
            for key, tokens in zip(keys.pc_keys[:held], keys.tokens[:held]):
                self._apply(home, self.caches[home].store(CacheKind.PC, key, tokens), t)
            self._input_ready(state, t)

        self.at(now + self.profile.link(worker, home).latency_s, serve)

    def _input_ready(self, state: RequestState, ready_at: float) -> None:
        state.ready_at = max(state.ready_at, ready_at)
        state.pending -= 1
        if state.pending == 0:
            self.at(state.ready_at, lambda t: self._enqueue_combine(state, t))

    # ---- scatter prefill on a worker ----------------------------------------------------------
    def _scatter_task(self, state, key: str, tokens: int, worker: int, task_id: str, now: float) -> None:
        if worker == state.plan.combine_home:
            self.producing[(worker, key)].append(lambda t: self._input_ready(state, t))
        else:
            self.producing[(worker, key)].append(lambda t: self._send_home(state, worker, key, tokens, t))
        tier = self.caches[worker].tier_of(CacheKind.PIC, key)
        if tier is Tier.HOST:
            self.at(self._promote(worker, CacheKind.PIC, key, tokens, now),
                    lambda t: self._scatter_done(worker, key, tokens, task_id, t))
        elif tier is Tier.DEVICE:
            self._scatter_done(worker, key, tokens, task_id, now)
        else:  # its KV reaches the home as this request's own work, not as a cache hit
            state.computed_for_it.add(key)
            self.queues[worker].scatters.append(ScatterJob(key, tokens, task_id, state.measured))
            self._start_next(worker, now)

    def _scatter_done(self, worker: int, key: str, tokens: int, task_id: str, now: float) -> None:
        self._stored(worker, key, tokens, now)
        self._emit(worker, lambda s: DoneEvent(worker, s, task_id), now)

    def _stored(self, worker: int, key: str, tokens: int, now: float) -> None:
        """A PIC segment computed (or found) on ``worker`` is in its store: wake whoever waits for it."""
        self._apply(worker, self.caches[worker].store(CacheKind.PIC, key, tokens), now)
        for waiter in self.producing.pop((worker, key), []):
            waiter(now)

    # ---- the combine on its home --------------------------------------------------------------
    def _enqueue_combine(self, state: RequestState, now: float) -> None:
        self.queues[state.plan.combine_home].combines.append(state)
        self._start_next(state.plan.combine_home, now)

    def _combine_work(self, state: RequestState) -> CombineWork:
        """The home engine's own match of the request against its cache (no side effects)."""
        keys, cache = state.keys, self.caches[state.plan.combine_home]
        depth = 0
        while depth < len(keys.pc_keys) and cache.tier_of(CacheKind.PC, keys.pc_keys[depth]) is not None:
            depth += 1
        prefix = keys.prefix_tokens(depth)
        earlier = 0  # leading chain entries an earlier request brought
        while earlier < depth and self.first_seen[keys.pc_keys[earlier]] < state.index:
            earlier += 1
        work = CombineWork([], [], [], keys.prefix_tokens(earlier), 0, keys.total_tokens - prefix)
        for i in range(depth):
            if cache.tier_of(CacheKind.PC, keys.pc_keys[i]) is Tier.HOST:
                work.host_tokens += keys.tokens[i] if i < earlier else 0
                work.promoted.append((CacheKind.PC, keys.pc_keys[i], keys.tokens[i]))
        pic = set(keys.pic_indices) if self.uses_pic else set()
        seen: set[str] = set()
        for i in range(depth, len(keys.tokens)):
            if i in pic:
                self._segment_work(state, keys.content_ids[i], keys.tokens[i], seen, work)
        regular = sum(keys.tokens[i] for i in range(depth, len(keys.tokens)) if i not in pic)
        reused = sum(keys.tokens[i] for i in range(depth, len(keys.tokens)) if i in pic)
        combine = regular + self.profile.combine_ratio * reused  # prefill tokens worth, attending to the rest
        work.sequences.append((combine, keys.total_tokens - combine))
        return work

    def _segment_work(self, state: RequestState, content: str, tokens: int, seen: set[str], work: CombineWork) -> None:
        """One PIC segment past the prefix: reused from the home's store (a host copy promoted), or, cold,
        prefilled alone in the combine's forward. An earlier copy in the request counts as a hit, as in the
        reuse analysis; a segment scatter-prefilled for this very request does not."""
        tier = None if content in seen else self.caches[state.plan.combine_home].tier_of(CacheKind.PIC, content)
        hit = content in seen or (tier is not None and content not in state.computed_for_it
                                  and self.first_seen[content] < state.index)
        if hit:
            work.hit_tokens += tokens
        elif tier is None:
            work.cold.append((content, tokens))
            work.sequences.append((tokens, 0.0))
        if tier is Tier.HOST:
            work.host_tokens += tokens if hit else 0
            work.promoted.append((CacheKind.PIC, content, tokens))
        seen.add(content)

    def _admit_combine(self, worker: int, state: RequestState, work: CombineWork, now: float) -> float:
        """Apply the admission's side effects; returns the seconds spent loading host copies."""
        cache, keys = self.caches[worker], state.keys
        load_end = now
        for kind, key, tokens in work.promoted:
            if cache.tier_of(kind, key) is Tier.HOST:
                load_end = max(load_end, self._promote(worker, kind, key, tokens, now))
            elif not cache.has(kind, key):  # an earlier promotion pushed it off the host: recompute it
                work.hit_tokens -= tokens if key not in state.computed_for_it else 0
                work.host_tokens -= tokens if key not in state.computed_for_it else 0
                work.sequences.insert(0, (tokens, 0.0))
        for key in keys.pc_keys:
            cache.touch(CacheKind.PC, key)
        for i in keys.pic_indices:
            cache.touch(CacheKind.PIC, keys.content_ids[i])
        self._apply(worker, cache.pin(work.pinned), now)
        self._count(state, "hit_tokens", work.hit_tokens)
        self._count(state, "host_hit_tokens", work.host_tokens)
        self._count(state, "computed", work.tokens, worker)
        return load_end - now

    def _combine_done(self, worker: int, state: RequestState, work: CombineWork, now: float) -> None:
        keys, plan = state.keys, state.plan
        for key, tokens in work.cold:
            self._stored(worker, key, tokens, now)
        for key, tokens in zip(reversed(keys.pc_keys), reversed(keys.tokens)):
            self._apply(worker, self.caches[worker].store(CacheKind.PC, key, tokens), now)
        for key in keys.pc_keys:
            for waiter in self.producing_pc.pop((worker, key), []):
                waiter(now)
        self._emit(worker, lambda s: DoneEvent(worker, s, plan.combine_task_id), now)
        handoff_bytes = keys.total_tokens * self.profile.kv_bytes_per_token
        self._count(state, "handoff_bytes", handoff_bytes)
        handed = self.links.transfer(worker, self.cluster.decode_worker, handoff_bytes, now)
        self.at(handed, lambda t: self.caches[worker].unpin(work.pinned))
        first_token = handed if self.config.ttft_includes_handoff else now
        self.last_completion = max(self.last_completion, first_token)
        if state.measured:
            self.ttfts.append(first_token - state.arrival)

    # ---- batched forwards ---------------------------------------------------------------------
    def _start_next(self, worker: int, now: float) -> None:
        queue = self.queues[worker]
        if queue.busy or not (queue.combines or queue.scatters):
            return
        budget, sequences, finishers, extra_s = self.profile.max_batch_tokens, [], [], 0.0
        while queue.combines:
            work = self._combine_work(queue.combines[0])
            if sequences and work.tokens > budget:
                break
            state = queue.combines.popleft()
            extra_s = max(extra_s, self._admit_combine(worker, state, work, now))
            sequences += work.sequences
            budget -= work.tokens
            finishers.append(lambda t, s=state, w=work: self._combine_done(worker, s, w, t))
        while queue.scatters and budget > 0:
            budget = self._take_scatter(worker, queue.scatters, budget, sequences, finishers, now)
        if not sequences:
            for finish in finishers:
                finish(now)
            self._start_next(worker, now)
            return
        queue.busy = True
        seconds = self.profile.prefill.batch_seconds(sequences) + extra_s
        self.processors[worker].start(worker, seconds, lambda t: self._step_done(worker, finishers, t), now)

    def _take_scatter(self, worker: int, scatters: deque, budget: float, sequences: list, finishers: list,
                      now: float) -> float:
        job = scatters[0]
        if job.done_tokens == 0 and self.caches[worker].has(CacheKind.PIC, job.key):
            scatters.popleft()  # computed here meanwhile: nothing left to do
            finishers.append(lambda t, j=job: self._scatter_done(worker, j.key, j.tokens, j.task_id, t))
            return budget
        chunk = min(job.tokens - job.done_tokens, int(budget))
        if chunk < 1:
            return 0.0
        sequences.append((chunk, job.done_tokens))
        job.done_tokens += chunk
        if job.measured:
            self.counters.computed_tokens[worker] += chunk
        if job.done_tokens >= job.tokens:
            scatters.popleft()
            self._apply(worker, self.caches[worker].pin(job.tokens), now)
            finishers.append(lambda t, j=job: self._finish_scatter(worker, j, t))
        return budget - chunk

    def _finish_scatter(self, worker: int, job: ScatterJob, now: float) -> None:
        self.caches[worker].unpin(job.tokens)
        self._scatter_done(worker, job.key, job.tokens, job.task_id, now)

    def _step_done(self, worker: int, finishers: list, now: float) -> None:
        self.queues[worker].busy = False
        for finish in finishers:
            finish(now)
        self._start_next(worker, now)

    def _count(self, state: RequestState, counter: str, amount: float, worker: int | None = None) -> None:
        if not state.measured:
            return
        if counter == "computed":
            self.counters.computed_tokens[worker] += amount
        else:
            setattr(self.counters, counter, getattr(self.counters, counter) + int(amount))


def simulate(config: SimulationConfig, requests: Sequence[Request]) -> SimulationReport:
    return Simulator(config, requests).run()

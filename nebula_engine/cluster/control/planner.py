"""Greedy prefill planning of §7.2 (Algorithm 1) over the completion-time estimate

    T(pi) = max_w [ Q_w(pi) + P_w(pi) + D_w(w -> c; pi) ] + C

in prefill-token units: Q_w counts only if w computes a cold segment, P_w is the cold tokens it
computes, D_w = d(w->c) * (all tokens w sends to the home c) plus, for hits on a slow tier, the
tier's per-token load cost. C, the combine prefill, is the same for every plan. §7.2 gives a combine whose KV
is ready priority at its home; on an engine that runs a home's work in arrival order (this one:
``TransferCosts.combine_queues``) the home's Q_c counts even when it computes nothing.

A peer of this project's local cluster prefills the prompt's lead (its regular tokens past the prefix hit, before
the first PIC segment) while its combine waits for remote KV (``TransferCosts.lead_while_waiting``). That part of C,
``PlanningProblem.lead``, is then the home's own work: it is added to the home's term (and to F below) and taken out
of the C added after the maximum, so helpers whose KV arrives while the home prefills the lead cost nothing. With
no lead this is §7.2's estimate.

Workers that share processors (a local cluster on one machine: ``ClusterProfile.shared_compute``) cannot
finish before the machine has done all the work it holds, whichever worker computes it. The estimate is then
max(T(pi), F) with F = (sum_w Q_w + all cold tokens + the lead) / the forwards the machine runs at full speed at once
(``TransferCosts.parallel_forwards``). F is the same for every plan and home, so it acts like one more worker
whose term no move changes: a move is still accepted iff the estimate drops, and once F is the maximum,
spreading cold segments gains nothing and they stay at the home. With dedicated processors F = 0, the paper's
estimate.

A worker that is down (silent: the router counts it dead) has an infinite Q_w. It is never a home or a helper,
and its queue is not in F: it holds no processor.

Speed (§9.5): for a fixed home the estimate is max(T_c, R) with R = max over the other workers. A
move only lowers T_c and raises the target's T, so R is updated in O(1), the least-loaded target comes
off a heap, and while T_c > R a move is accepted iff the target's new T stays below T_c. A rejected
move leaves the plan unchanged, so the next segment that can be accepted is found by bisection
(lengths are sorted). Once T_c <= R no move can lower the maximum and the home is done. R is also a
lower bound on the home's final estimate, so a home whose R passes the best estimate so far is
dropped; homes are tried from the least loaded up so that bound tightens early. None of this
changes the result: tests check it against Algorithm 1 written out literally.

Two implementations of that loop give identical plans. ``GreedyPlanner._plan_home`` below is the
readable reference; ``planner_kernel.plan_homes`` is the same loop compiled with numba, used when numba
imports, because CPython's per-step cost alone (~0.2 us x 16 homes x 128 cold segments) exceeds §9.5's
0.32 ms at 256 segments x 16 workers. ``tools/bench_planner.py`` measures both shapes the paper quotes.
"""

from __future__ import annotations

import functools
import heapq
import logging
import math
import random
from bisect import bisect_right
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Sequence, TypeVar

import numpy as np

from nebula_engine.cluster.control.config import ClusterProfile
from nebula_engine.cluster.control.messages import Tier

logger = logging.getLogger(__name__)

NO_WORKER_UP = "every prefill worker is down: nothing can take the request"
T = TypeVar("T")
K = TypeVar("K")


class TransferCosts:
    """d(w -> c) for every pair, stored by destination: ``to[c][w]`` (and as ``matrix[c, w]`` for the
    compiled planner), and the per-token cost of reading a copy from each tier. A tier without a cost
    cannot be read (infinite cost). Built once per profile and not modified afterwards.

    ``latency[c][w]``: the fixed cost, in prefill tokens, that worker w adds to a plan with home c once it
    sends the home anything (a link's latency; on a local cluster the pin round trip and engine-thread hops).
    ``dispatch[c][w]``: the fixed cost, in prefill tokens, that worker w adds once it computes a cold segment for
    home c (``ClusterProfile.dispatch_s``), on top of its latency.
    §7.2's estimate has per-token terms only; these terms are 0 unless given, which is Algorithm 1 exactly.
    ``parallel_forwards``: how many prefills the workers' shared processors run at once at full speed (infinite:
    each worker has its own, the paper's setting); it sets the floor F of the module docstring.
    ``combine_queues``: the home's queue Q_c counts in its term whether or not it computes a cold segment, since
    the combine waits behind it (``ClusterProfile.combine_queues``); False is §7.2's estimate.
    ``lead_while_waiting``: the home prefills the prompt's lead while it waits for remote KV, so a policy plans the
    lead as the home's own work (``PlanningProblem.lead``, ``ClusterProfile.lead_while_waiting``).
    ``expected_copies_wait``: a policy plans a read of a copy not stored yet after its holder's work before it
    (``PlanningProblem.source_wait``, ``ClusterProfile.expected_copies_wait``)."""

    def __init__(self, to: Sequence[Sequence[float]], tier_cost: dict[Tier, float] | None = None,
                 latency: Sequence[Sequence[float]] | None = None,
                 dispatch: Sequence[Sequence[float]] | None = None, parallel_forwards: float = math.inf,
                 combine_queues: bool = False, lead_while_waiting: bool = False,
                 expected_copies_wait: bool = False):
        if not parallel_forwards > 0:
            raise ValueError(f"parallel_forwards must be positive, got {parallel_forwards}")
        self.parallel_forwards = float(parallel_forwards)
        self.combine_queues = combine_queues
        self.lead_while_waiting = lead_while_waiting
        self.expected_copies_wait = expected_copies_wait
        self.to = [list(column) for column in to]
        self.tier_cost = {**{tier: math.inf for tier in Tier}, **(tier_cost or {}), Tier.DEVICE: 0.0}
        self.num_workers = len(self.to)
        self.matrix = np.array(self.to, dtype=np.float64).reshape(self.num_workers, self.num_workers)
        self.latency, self.latency_matrix = self._fixed_costs(latency, "a worker has no latency to itself")
        self.dispatch, self.dispatch_matrix = self._fixed_costs(
            dispatch, "a worker computing for itself has no dispatch cost")

    def _fixed_costs(self, costs: Sequence[Sequence[float]] | None, on_diagonal: str
                     ) -> tuple[list[list[float]], np.ndarray]:
        """``costs[c][w]`` as lists and as the compiled planner's array (all 0 when None); ValueError
        ``on_diagonal`` when a worker would pay one to itself."""
        n = self.num_workers
        rows = [list(column) for column in costs] if costs is not None else [[0.0] * n for _ in range(n)]
        if any(rows[c][c] for c in range(n)):
            raise ValueError(on_diagonal)
        return rows, np.array(rows, dtype=np.float64).reshape(n, n)

    @classmethod
    def from_profile(cls, profile: ClusterProfile, num_workers: int) -> "TransferCosts":
        to = [[profile.relative_transfer_cost(w, c) for w in range(num_workers)]
              for c in range(num_workers)]
        latency = [[profile.relative_transfer_latency(w, c) for w in range(num_workers)]
                   for c in range(num_workers)]
        dispatch = [[profile.relative_dispatch(w, c) for w in range(num_workers)] for c in range(num_workers)]
        nodes = len({profile.node_of(w) for w in range(num_workers)})
        parallel = profile.node_cores * nodes if profile.shared_compute else math.inf
        return cls(to, {tier: profile.tier_cost(tier) for tier in Tier}, latency, dispatch, parallel,
                   profile.combine_queues, profile.lead_while_waiting, profile.expected_copies_wait)

    def work_floor(self, problem: "PlanningProblem") -> float:
        """F: the time the shared processors need for all queued work plus this request's cold segments and the
        lead its home prefills while it waits (0 when every worker has its own processor)."""
        if math.isinf(self.parallel_forwards):
            return 0.0
        return (sum(q for q in problem.outstanding if q < math.inf) + sum(problem.cold) + problem.lead) \
            / self.parallel_forwards

    def copy_cost(self, tier: Tier, src: int, home: int) -> float:
        """Per-token cost, in prefill tokens, of reading a copy on ``tier`` at ``src`` and moving it to ``home``."""
        return self.tier_cost[tier] + self.to[home][src]

    def load_beats_recompute(self, tier: Tier, src: int, home: int, num_tokens: float) -> bool:
        """Is reading the ``num_tokens`` copy on ``tier`` at ``src`` and moving it to ``home`` (the link's latency
        included) cheaper than recomputing it (one prefill token per token)?"""
        return self.copy_cost(tier, src, home) * num_tokens + self.latency[home][src] < num_tokens


@dataclass(frozen=True)
class Hit:
    """A cached segment (or the matched prefix) with the workers that can supply it."""

    num_tokens: int
    holders: tuple[tuple[int, Tier], ...]


@dataclass(frozen=True)
class PlanningProblem:
    hits: tuple[Hit, ...]
    cold: tuple[int, ...]  # lengths of the cold PIC segments
    outstanding: tuple[float, ...]  # Q_w, excluding this request; infinite for a worker that is down
    combine_cost: float  # C
    # the part of C the home computes while remote KV is in flight (the prompt's lead, ``TransferCosts.
    # lead_while_waiting``): counted in the home's term and in F instead of after the maximum; 0 is §7.2's estimate
    lead: float = 0.0
    # per worker, what a plan that reads from it waits before its copies exist, in prefill tokens: a copy the view
    # only expects (recorded on dispatch) is computed behind that worker's queue (``ClusterView.wait_tokens``).
    # Added to a source's term, not the home's (a home reading its own copy waits for its queue anyway when its
    # combine queues; in §7.2's model its combine has priority). Empty: no waits, Algorithm 1's estimate
    source_wait: tuple[float, ...] = ()

    def __post_init__(self):
        if self.source_wait and len(self.source_wait) != len(self.outstanding):
            raise ValueError(f"source_wait has {len(self.source_wait)} entries for {len(self.outstanding)} workers")
        if any(not wait >= 0 for wait in self.source_wait):
            raise ValueError(f"source_wait must be non-negative, got {self.source_wait}")

    def waits(self) -> np.ndarray:
        """``source_wait`` as the compiled planner's array (zeros when empty)."""
        return np.array(self.source_wait or (0.0,) * len(self.outstanding), dtype=np.float64)

    @property
    def after_wait(self) -> float:
        """What the combine computes once its KV is all there: C less the lead."""
        return self.combine_cost - self.lead


@dataclass(frozen=True)
class GreedyPlan:
    home: int
    cold_workers: tuple[int, ...]  # worker computing each cold segment, in problem order
    hit_sources: tuple[int, ...]  # worker supplying each hit, in problem order
    estimate: float


def workers_up(problem: PlanningProblem) -> list[int]:
    """The workers that can take work (a finite queue); ValueError when none can."""
    up = [w for w, queue in enumerate(problem.outstanding) if queue < math.inf]
    if not up:
        raise ValueError(NO_WORKER_UP)
    return up


def home_candidates(problem: PlanningProblem, homes: Sequence[int] | None) -> list[int]:
    """The workers a plan may make its home, in id order: ``homes`` (None: every worker up); ValueError when one
    of them is down, or when every worker is."""
    up = workers_up(problem)
    if homes is None:
        return up
    if not set(homes) <= set(up):
        raise ValueError(f"homes {sorted(set(homes))} must be workers that are up")
    return [w for w in up if w in set(homes)]


def break_tie(candidates: Sequence[T], home_of: Callable[[T], int], outstanding: Sequence[float],
              rng: random.Random) -> T:
    """One of ``candidates`` (plans, or homes, that tie): among those whose home has the shortest queue, the only
    one, else one drawn by ``rng``. With shared processors the floor F often makes every home's estimate equal (a
    busy home's combine then looks as soon done as an idle one's); the engine runs a home's work in arrival order,
    so the shorter queue starts the combine first. Without a floor, ties come from equal loads and all stay."""
    shortest = min(outstanding[home_of(c)] for c in candidates)
    lightest = [c for c in candidates if outstanding[home_of(c)] == shortest]
    return lightest[0] if len(lightest) == 1 else rng.choice(lightest)


def worker_time(queue: float, computed: float, d: float, fixed: float) -> float:
    """One worker's term of the estimate; ``queue`` is Q_w only when it computes something."""
    return queue + computed + d * computed + fixed


def hit_source(hit: Hit, home: int, costs: TransferCosts) -> int:
    """The copy a plan with this home reads: the cheapest to load and move there (its own device copy costs
    nothing); on a tie the home's own copy, then the lowest worker id."""
    column = costs.to[home]
    return min(hit.holders,
               key=lambda h: (column[h[0]] + costs.tier_cost[h[1]], h[0] != home, h[0]))[0]


def readable_copies(holders: dict[K, tuple[tuple[int, Tier], ...]], length: dict[K, int], home: int,
                    costs: TransferCosts, wait: dict[K, float] | None = None,
                    home_queue: float = 0.0) -> dict[K, tuple[tuple[int, Tier], ...]]:
    """Per segment (``holders``: its copies; ``length``: its tokens), the copies a combine at ``home`` reads rather
    than recomputes. A copy must cost less per token to load and move there than recomputing it (§7.2's d(w -> c)
    plus the tier's read cost), and a source worker must save, over every copy the home reads from it (``hit_source``
    picks which), more than its link's latency, which it pays once however many copies it sends
    (``TransferCosts.latency``). A source that does not is dropped for every segment and those segments go to their
    next cheapest holder, until every source left pays. With no latency a device copy always passes, as in
    Algorithm 1; with it, short segments held elsewhere are hits only for a home that holds them, or when enough of
    them come from one source.

    ``wait``: per segment whose copies do not exist yet (expected where a plan computes them), the prefill tokens its
    holder works before they do (``ClusterView.wait_tokens``); such a segment must have one holder. A source then
    also pays the longest such wait, less ``home_queue`` when the home's combine waits for its queue anyway
    (``TransferCosts.combine_queues``); a copy the home holds itself waits for nothing more than that queue."""
    wait = wait or {}
    covered = home_queue if costs.combine_queues else 0.0
    kept = {key: tuple((w, tier) for w, tier in copies if costs.copy_cost(tier, w, home) < 1.0)
            for key, copies in holders.items()}
    while True:
        saved: dict[int, float] = {}
        waited: dict[int, float] = {}
        for key, copies in kept.items():
            if copies:
                src = hit_source(Hit(length[key], copies), home, costs)
                tier = next(t for w, t in copies if w == src)
                saved[src] = saved.get(src, 0.0) + length[key] * (1.0 - costs.copy_cost(tier, src, home))
                if src != home:
                    waited[src] = max(waited.get(src, 0.0), wait.get(key, 0.0))
        dropped = {src for src, tokens in saved.items()
                   if not costs.latency[home][src] + max(0.0, waited.get(src, 0.0) - covered) < tokens}
        if not dropped:
            return kept
        kept = {key: tuple(c for c in copies if c[0] not in dropped) for key, copies in kept.items()}


TIERS = tuple(Tier)
TIER_INDEX = {tier: i for i, tier in enumerate(TIERS)}


def hit_tokens_by_source(hits: Sequence[Hit], home: int, costs: TransferCosts,
                         base: dict | None = None) -> dict[int, list[int]]:
    """Per source worker, tokens it supplies to ``home`` from each tier (in ``TIERS`` order).

    ``base`` holds pre-summed single-copy hits, whose source does not depend on the home.
    """
    grouped = {src: list(tokens) for src, tokens in base.items()} if base else {}
    for hit in hits:
        src = hit_source(hit, home, costs)
        tier = next(t for w, t in hit.holders if w == src)
        grouped.setdefault(src, [0] * len(TIERS))[TIERS.index(tier)] += hit.num_tokens
    return grouped


def summarise(grouped: dict[int, list[int]], costs: TransferCosts) -> dict[int, tuple[int, float]]:
    """Per source worker: (tokens it sends, cost of reading them from slow tiers), home-independent."""
    tier_cost = [costs.tier_cost[t] for t in TIERS]
    return {src: (sum(tokens), sum(n * c for n, c in zip(tokens, tier_cost) if n))
            for src, tokens in grouped.items()}


def fixed_transfer(summary: dict[int, tuple[int, float]], home: int,
                   costs: TransferCosts, wait: Sequence[float] = ()) -> dict[int, float]:
    """Per source worker: cost of moving to ``home`` (and reading from a slow tier) what it supplies, plus the
    latency of its link to ``home``, plus what it waits before its copies exist (``PlanningProblem.source_wait``)."""
    column, latency = costs.to[home], costs.latency[home]
    return {src: column[src] * tokens + extra + latency[src] + (wait[src] if wait and src != home else 0.0)
            for src, (tokens, extra) in summary.items()}


@functools.cache
def compiled_kernel() -> ModuleType | None:
    """The numba-compiled greedy loop, or None (after one warning) when numba is not installed.

    Imported on first use rather than with this module: importing numba costs ~0.3 s.
    """
    try:
        from nebula_engine.cluster.control import planner_kernel
    except ImportError as error:
        logger.warning("numba is unavailable (%s): GreedyPlanner runs its pure-Python loop instead, "
                       "about 3.5x slower than §9.5's 0.32 ms at 256 segments x 16 workers "
                       "(pip install 'nebula-engine[cluster]' brings numba)", error)
        return None
    return planner_kernel


def supplied_by_source(hits: Sequence[Hit], costs: TransferCosts) -> tuple[np.ndarray, np.ndarray]:
    """Per source worker: tokens it sends to the home and the cost of reading them from slow tiers.

    One row shared by every home when each hit has a single copy; otherwise one row per home, since
    which copy a multi-copy hit reads depends on the home. Values equal ``summarise``'s exactly.
    """
    single = [[0] * costs.num_workers for _ in TIERS]  # [tier][source] tokens of single-copy hits
    multi = []
    for hit in hits:
        holders = hit.holders
        if len(holders) == 1:  # hit_source without the search: the only copy
            src, tier = holders[0]
            single[TIER_INDEX[tier]][src] += hit.num_tokens
        else:
            multi.append(hit)
    rows = np.array([single], dtype=np.int64) if not multi else rows_per_home(single, multi, costs)
    return summarise_rows(rows, costs)


def rows_per_home(single: list[list[int]], hits: Sequence[Hit], costs: TransferCosts) -> np.ndarray:
    """[home, tier, source] tokens: ``single`` plus every multi-copy hit read from the copy ``hit_source`` picks
    for that home (the same keys in the same order: cost, then the home's own copy, then the lowest id)."""
    hit_ids = np.array([i for i, hit in enumerate(hits) for _ in hit.holders], dtype=np.int64)
    workers = np.array([w for hit in hits for w, _ in hit.holders], dtype=np.int64)
    tiers = np.array([TIER_INDEX[t] for hit in hits for _, t in hit.holders], dtype=np.int64)
    tier_cost = np.array([costs.tier_cost[TIERS[t]] for t in tiers], dtype=np.float64)
    tokens = np.array([hit.num_tokens for hit in hits for _ in hit.holders], dtype=np.int64)
    rows = np.repeat(np.array([single], dtype=np.int64), costs.num_workers, axis=0)
    for home in range(costs.num_workers):
        cost = costs.matrix[home, workers] + tier_cost
        order = np.lexsort((workers, workers != home, cost, hit_ids))  # by hit, then hit_source's key
        ordered = hit_ids[order]
        first = order[np.concatenate(([True], ordered[1:] != ordered[:-1]))]
        np.add.at(rows[home], (tiers[first], workers[first]), tokens[first])
    return rows


def summarise_rows(by_tier: np.ndarray, costs: TransferCosts) -> tuple[np.ndarray, np.ndarray]:
    """``summarise`` over arrays [row, tier, source]: (tokens sent, slow-tier cost) per row and source.

    Same operations in the same order: the cost starts at 0 and adds n * cost tier by tier, skipping
    tiers the source sends nothing from (so an infinite tier cost cannot turn 0 tokens into NaN).
    """
    tokens = by_tier.sum(axis=1)
    extra = np.zeros(tokens.shape, dtype=np.float64)
    for index, tier in enumerate(TIERS):
        sent = by_tier[:, index]
        nonzero = sent != 0
        extra[nonzero] += sent[nonzero] * costs.tier_cost[tier]
    return tokens, extra


class GreedyPlanner:
    """Algorithm 1. Ties between equally good homes go to the least loaded ones, then a seeded RNG.

    ``compiled`` selects the loop: None uses the numba kernel when it imports, False forces the
    pure-Python reference, True requires the kernel. Both give identical plans.
    """

    def __init__(self, costs: TransferCosts, seed: int = 0, compiled: bool | None = None):
        self.costs = costs
        self.rng = random.Random(seed)
        self.kernel = compiled_kernel() if compiled is not False else None
        if compiled and self.kernel is None:
            raise RuntimeError("GreedyPlanner(compiled=True) needs numba, which failed to import")

    def plan(self, problem: PlanningProblem, homes: Sequence[int] | None = None) -> GreedyPlan:
        """The best plan whose combine home is one of ``homes`` (None: any worker that is up); every worker
        that is up may still compute cold segments."""
        candidates = set(home_candidates(problem, homes))
        if self.kernel is None:
            return self._plan_python(problem, candidates)
        return self._plan_compiled(problem, candidates)

    def _plan_compiled(self, problem: PlanningProblem, candidates: set[int]) -> GreedyPlan:
        cold = np.array(problem.cold, dtype=np.int64)
        # stable sorts reproduce the Python path's keys (-length, index) and (load, worker)
        order = np.argsort(-cold, kind="stable")
        queue = np.array(problem.outstanding, dtype=np.float64)
        up = np.array(workers_up(problem), dtype=np.int64)  # a worker that is down is neither home nor helper
        by_load = up[np.argsort(queue[up], kind="stable")]
        homes = np.array([w for w in by_load.tolist() if w in candidates], dtype=np.int64)
        tokens, extra = supplied_by_source(problem.hits, self.costs)
        estimates, moved = self.kernel.plan_homes(self.costs.matrix, self.costs.latency_matrix,
                                                  self.costs.dispatch_matrix, queue, by_load, homes,
                                                  cold[order], tokens, extra, problem.waits(),
                                                  self.costs.work_floor(problem),
                                                  self.costs.combine_queues, float(problem.lead))
        best = estimates.min()
        home = break_tie(np.flatnonzero(estimates == best).tolist(), int, problem.outstanding, self.rng)  # ascending
        cold_workers = np.empty_like(cold)
        cold_workers[order] = moved[home]
        return GreedyPlan(home, tuple(cold_workers.tolist()), self._hit_sources(problem.hits, home),
                          float(best) + problem.after_wait)

    def _hit_sources(self, hits: Sequence[Hit], home: int) -> tuple[int, ...]:
        return tuple(hit.holders[0][0] if len(hit.holders) == 1 else hit_source(hit, home, self.costs)
                     for hit in hits)

    def _plan_python(self, problem: PlanningProblem, candidates: set[int]) -> GreedyPlan:
        order = sorted(range(len(problem.cold)), key=lambda i: (-problem.cold[i], i))
        lengths = [problem.cold[i] for i in order]
        negated = [-length for length in lengths]
        queue = problem.outstanding
        by_load = sorted((queue[w], w) for w in workers_up(problem))  # down: neither home nor helper
        position = {w: i for i, (_, w) in enumerate(by_load)}
        single = hit_tokens_by_source([h for h in problem.hits if len(h.holders) == 1], 0, self.costs)
        single_summary = summarise(single, self.costs)
        multi = [h for h in problem.hits if len(h.holders) > 1]
        floor = self.costs.work_floor(problem)
        best, best_homes = float("inf"), []
        for _, home in by_load:  # lightly loaded homes tend to win: a low bound early prunes the rest
            if home not in candidates:
                continue
            summary = summarise(hit_tokens_by_source(multi, home, self.costs, single), self.costs) \
                if multi else single_summary
            estimate, moves = self._plan_home(problem, home, lengths, negated, by_load, position,
                                              summary, best, floor)
            if estimate < best:
                best, best_homes = estimate, [(home, moves)]
            elif estimate == best:
                best_homes.append((home, moves))
        best_homes.sort(key=lambda candidate: candidate[0])
        home, moves = break_tie(best_homes, lambda candidate: candidate[0], queue, self.rng)
        cold_workers = [home] * len(lengths)
        for rank, worker in moves:
            cold_workers[order[rank]] = worker
        sources = tuple(hit_source(hit, home, self.costs) for hit in problem.hits)
        return GreedyPlan(home, tuple(cold_workers), sources, best + problem.after_wait)

    def _plan_home(self, problem, home, lengths, negated, by_load, position, summary, bound, floor):
        """Greedy moves for one home; returns (max(max_w T_w, floor), [(rank of cold segment, worker)]).

        Stops early, returning an estimate above ``bound``, once the home cannot end at or below it:
        the maximum over the other workers only grows, so it is a lower bound on the result.
        """
        column, queue, latency = self.costs.to[home], problem.outstanding, self.costs.latency[home]
        dispatch = self.costs.dispatch[home]
        fixed = fixed_transfer(summary, home, self.costs, problem.source_wait)
        home_fixed = fixed.get(home, 0.0)
        home_queue = queue[home]
        if self.costs.combine_queues:  # the combine waits for the home's queue: a fixed part of the home's term
            home_fixed, home_queue = home_fixed + home_queue, 0.0
        home_fixed += problem.lead
        others = max((f for w, f in fixed.items() if w != home), default=0.0) if home in fixed \
            else max(fixed.values(), default=0.0)
        others = max(others, floor)  # F: a term no move changes, like a source's
        if others > bound:
            return others, []
        remaining = sum(lengths)
        home_time = worker_time(home_queue if remaining else 0.0, remaining, 0.0, home_fixed)
        heap = by_load.copy()
        del heap[position[home]]  # a sorted list stays a valid heap
        computed = [0] * len(queue)
        moved = [home] * len(lengths)  # worker of each cold segment, by rank
        rank, count = 0, len(lengths) if heap and home_time > others else 0
        replace_top, get_fixed = heapq.heapreplace, fixed.get
        while rank < count:
            length = lengths[rank]
            worker = heap[0][1]
            mine = computed[worker]
            after = mine + length
            d = column[worker]
            # inlined worker_time(queue[worker], after, d, fixed): this is the hot loop
            target = queue[worker] + after + d * after + get_fixed(worker, latency[worker]) + dispatch[worker]
            if target < home_time:
                computed[worker] = after
                moved[rank] = worker
                remaining -= length
                home_time = (home_queue if remaining else 0.0) + remaining + 0.0 * remaining + home_fixed
                if target > others:
                    others = target
                    if others > bound:
                        return others, []
                if home_time <= others:
                    break  # the maximum is now elsewhere: no later move can lower it
                replace_top(heap, (queue[worker] + after, worker))
                rank += 1
                continue
            # Rejected: nothing changed, so skip every segment at least as long as the limit.
            slack = home_time - (worker_time(queue[worker], mine, d, get_fixed(worker, latency[worker]))
                                 + dispatch[worker])
            limit = slack / (1.0 + d)
            rank = bisect_right(negated, -(limit + abs(limit) * 1e-9 + 1e-9), rank + 1)
        moves = [(r, w) for r, w in enumerate(moved) if w != home]
        return max(home_time, others), moves


def estimate(problem: PlanningProblem, home: int, cold_workers: Sequence[int],
             hit_sources: Sequence[int], costs: TransferCosts) -> float:
    """T(pi) of §7.2 computed from scratch for a complete plan (used to check the fast path)."""
    column = costs.to[home]
    computed = [0.0] * costs.num_workers
    for length, worker in zip(problem.cold, cold_workers):
        computed[worker] += length
    grouped: dict[int, list[int]] = {}
    for hit, src in zip(problem.hits, hit_sources):
        tier = next(t for w, t in hit.holders if w == src)
        grouped.setdefault(src, [0] * len(TIERS))[TIERS.index(tier)] += hit.num_tokens
    fixed = fixed_transfer(summarise(grouped, costs), home, costs, problem.source_wait)
    latency, dispatch = costs.latency[home], costs.dispatch[home]
    terms = [worker_time(problem.outstanding[w] if computed[w] else 0.0, computed[w], column[w],
                         fixed.get(w, latency[w] if computed[w] else 0.0)) + (dispatch[w] if computed[w] else 0.0)
             for w in range(costs.num_workers)]
    # the home's term in the planner's operation order: its queue (always, when the combine waits behind it), then
    # the lead it prefills while it waits (a worker pays no latency or dispatch to itself)
    home_queue, home_fixed = problem.outstanding[home] if computed[home] else 0.0, fixed.get(home, 0.0)
    if costs.combine_queues:
        home_queue, home_fixed = 0.0, home_fixed + problem.outstanding[home]
    terms[home] = worker_time(home_queue, computed[home], column[home], home_fixed + problem.lead)
    return max(max(terms), costs.work_floor(problem)) + problem.after_wait

"""Prefill schedulers over one :class:`PlanningProblem`: Nebula's greedy (Algorithm 1) and the two
strawmen of §7.1. All return a :class:`GreedyPlan`; names are the ones users type."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Sequence

from nebula_engine.cluster.control.planner import (GreedyPlan, GreedyPlanner, PlanningProblem, TransferCosts,
                                                  break_tie, estimate, hit_source, home_candidates, workers_up)


class Scheduler(ABC):
    def __init__(self, costs: TransferCosts, seed: int = 0):
        self.costs = costs
        self.rng = random.Random(seed)

    @abstractmethod
    def place(self, problem: PlanningProblem, homes: Sequence[int] | None = None) -> GreedyPlan:
        """Choose a combine home (one of ``homes``; None: any worker that is up), a source per hit and a worker
        per cold segment."""

    def set_costs(self, costs: TransferCosts) -> None:
        self.costs = costs

    def _finish(self, problem: PlanningProblem, home: int, cold_workers: list[int]) -> GreedyPlan:
        sources = tuple(hit_source(hit, home, self.costs) for hit in problem.hits)
        return GreedyPlan(home, tuple(cold_workers), sources,
                          estimate(problem, home, cold_workers, sources, self.costs))


class GreedyScheduler(Scheduler):
    """Nebula: minimise the estimated prefill completion time (§7.2)."""

    def __init__(self, costs: TransferCosts, seed: int = 0):
        super().__init__(costs, seed)
        self.planner = GreedyPlanner(costs, seed)

    def set_costs(self, costs: TransferCosts) -> None:
        super().set_costs(costs)
        self.planner.costs = costs

    def place(self, problem: PlanningProblem, homes: Sequence[int] | None = None) -> GreedyPlan:
        return self.planner.plan(problem, homes)


class LocalityScheduler(Scheduler):
    """Home = the worker with the most local PC/PIC hit tokens; cold segments computed there."""

    def place(self, problem: PlanningProblem, homes: Sequence[int] | None = None) -> GreedyPlan:
        local = dict.fromkeys(home_candidates(problem, homes), 0)
        for hit in problem.hits:
            for worker, _ in hit.holders:
                if worker in local:
                    local[worker] += hit.num_tokens
        most = max(local.values())
        ties = [w for w, n in local.items() if n == most]
        home = break_tie(ties, int, problem.outstanding, self.rng)
        return self._finish(problem, home, [home] * len(problem.cold))


class LoadScheduler(Scheduler):
    """Longest-processing-time first: each task, combine included, to the least-loaded worker."""

    COMBINE = -1

    def place(self, problem: PlanningProblem, homes: Sequence[int] | None = None) -> GreedyPlan:
        load, up, candidates = list(problem.outstanding), workers_up(problem), home_candidates(problem, homes)
        tasks = [(length, i) for i, length in enumerate(problem.cold)]
        tasks.append((problem.combine_cost, self.COMBINE))
        tasks.sort(key=lambda task: (-task[0], task[1]))
        cold_workers, home = [0] * len(problem.cold), 0
        for size, index in tasks:
            worker = min(candidates if index == self.COMBINE else up, key=lambda w: (load[w], w))
            load[worker] += size
            if index == self.COMBINE:
                home = worker
            else:
                cold_workers[index] = worker
        return self._finish(problem, home, cold_workers)


SCHEDULERS: dict[str, type[Scheduler]] = {
    "greedy": GreedyScheduler,
    "locality": LocalityScheduler,
    "load": LoadScheduler,
}

"""Algorithm 1 written out literally (slow): the oracle the fast planner is checked against."""

from __future__ import annotations

import random

from nebula_engine.cluster.control.planner import GreedyPlan, PlanningProblem, TransferCosts, estimate, hit_source


def reference_plan(problem: PlanningProblem, costs: TransferCosts, rng: random.Random) -> GreedyPlan:
    workers = range(costs.num_workers)
    order = sorted(range(len(problem.cold)), key=lambda i: (-problem.cold[i], i))
    candidates = []
    for home in workers:
        sources = [hit_source(h, home, costs) for h in problem.hits]
        assignment = [home] * len(problem.cold)
        current = estimate(problem, home, assignment, sources, costs)
        for i in order:
            others = [v for v in workers if v != home]
            if not others:
                break
            load = {v: problem.outstanding[v] + sum(problem.cold[j] for j in range(len(assignment))
                                                    if assignment[j] == v) for v in others}
            target = min(others, key=lambda v: (load[v], v))
            trial = list(assignment)
            trial[i] = target
            trial_estimate = estimate(problem, home, trial, sources, costs)
            if trial_estimate < current:
                assignment, current = trial, trial_estimate
        candidates.append((current, home, tuple(assignment), tuple(sources)))
    best = min(c[0] for c in candidates)
    ties = [c for c in candidates if c[0] == best]
    shortest = min(problem.outstanding[c[1]] for c in ties)  # ties: the least loaded homes, then the RNG
    ties = [c for c in ties if problem.outstanding[c[1]] == shortest]
    chosen = ties[0] if len(ties) == 1 else rng.choice(ties)
    return GreedyPlan(chosen[1], chosen[2], chosen[3], chosen[0])

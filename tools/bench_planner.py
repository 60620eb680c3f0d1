"""Planner latency as in the paper's §9.5 (Fig. 19): median of 1,024 planning calls after 64 warm-ups
on one pinned core. Segment lengths uniform in 128-2,048 tokens, outstanding loads uniform in
0-8,192 tokens, half the segments cache hits, each on a uniformly chosen worker. Transfer costs come
from the default profile's topology (4 workers per node).

    python tools/bench_planner.py            # the two settings the paper quotes
    python tools/bench_planner.py --sweep    # the whole of Fig. 19
    python tools/bench_planner.py --pure-python   # the reference loop, without the numba kernel

The numba kernel is compiled (or loaded from its on-disk cache) when the planner is built, before
any timed call; the warm-ups cover the rest of the first-call cost.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from nebula_engine.cluster.control.config import ClusterProfile
from nebula_engine.cluster.control.messages import Tier
from nebula_engine.cluster.control.planner import GreedyPlanner, Hit, PlanningProblem, TransferCosts

PAPER_MS = {(256, 16): 0.32, (16, 256): 4.43}
WARMUP, CALLS = 64, 1024


def make_problem(rng: random.Random, segments: int, workers: int) -> PlanningProblem:
    lengths = [rng.randint(128, 2048) for _ in range(segments)]
    hit_indices = set(rng.sample(range(segments), segments // 2))
    hits = tuple(Hit(lengths[i], ((rng.randrange(workers), Tier.DEVICE),)) for i in sorted(hit_indices))
    cold = tuple(lengths[i] for i in range(segments) if i not in hit_indices)
    loads = tuple(float(rng.randint(0, 8192)) for _ in range(workers))
    return PlanningProblem(hits, cold, loads, combine_cost=0.0)


def median_ms(segments: int, workers: int, compiled: bool | None, seed: int = 0) -> float:
    costs = TransferCosts.from_profile(ClusterProfile.load(), workers)
    planner = GreedyPlanner(costs, seed, compiled=compiled)
    rng = random.Random(seed)
    problems = [make_problem(rng, segments, workers) for _ in range(WARMUP + CALLS)]
    timings = []
    for problem in problems:
        start = time.perf_counter()
        planner.plan(problem)
        timings.append(time.perf_counter() - start)
    return 1e3 * statistics.median(timings[WARMUP:])


def pin_one_core() -> str:
    if hasattr(os, "sched_setaffinity"):
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        return f"pinned to core {core}"
    return "not pinned (no sched_setaffinity on this platform)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="all of Fig. 19, not just the quoted points")
    parser.add_argument("--pure-python", action="store_true", help="time the reference loop, not numba's")
    args = parser.parse_args()
    compiled = False if args.pure_python else None
    loop = "numba kernel" if GreedyPlanner(TransferCosts([[0.0]]), compiled=compiled).kernel else "pure Python"
    print(f"planner benchmark ({loop}), {pin_one_core()}; median of {CALLS} calls after {WARMUP} warm-ups")
    settings = [(256, 16), (16, 256)]
    if args.sweep:
        settings = [(s, 16) for s in (8, 16, 32, 64, 128, 256)] + [(16, w) for w in (8, 16, 32, 64, 128, 256)]
    print(f"{'segments':>8} {'workers':>7} {'ours ms':>8} {'paper ms':>8} {'ours/paper':>10}")
    for segments, workers in settings:
        ours = median_ms(segments, workers, compiled)
        paper = PAPER_MS.get((segments, workers))
        ratio = f"{ours / paper:10.2f}" if paper else f"{'-':>10}"
        print(f"{segments:8d} {workers:7d} {ours:8.3f} {paper if paper else '-':>8} {ratio}")


if __name__ == "__main__":
    main()

"""The per-home greedy loop of :class:`~nebula_engine.cluster.planner.GreedyPlanner`, compiled by numba.

This is ``GreedyPlanner._plan_home`` (the documented pure-Python path) statement for statement, over
arrays instead of dicts and a heap of tuples, so that §9.5's 256 segments x 16 workers fits in the
paper's 0.32 ms: CPython's ~0.2 us per greedy step alone exceeds that budget. Every floating-point
expression keeps the Python path's operands and order (numba does not reassociate or fuse without
``fastmath``), so both paths return identical plans; tests check that against Algorithm 1.

Signatures are explicit so that a caller passing another dtype gets an error instead of a silent
recompile, and ``cache=True`` compiles once per machine (into ``__pycache__``), not once per process.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# (rows of to, rows of latency, rows of dispatch, queue, workers up by load, homes to try by load, cold lengths longest
# first, tokens and extra per source, each source's wait for its copies, the shared processors' work floor, whether a
# combine waits for its home's queue, the lead the home prefills while it waits)
PLAN_HOMES_SIGNATURE = "Tuple((float64[::1], int64[:, ::1]))(float64[:, ::1], float64[:, ::1], float64[:, ::1], " \
                       "float64[::1], int64[::1], int64[::1], int64[::1], int64[:, ::1], float64[:, ::1], " \
                       "float64[::1], float64, boolean, float64)"


@njit("boolean(float64, int64, float64, int64)", cache=True)
def _precedes(load: float, worker: int, other_load: float, other_worker: int) -> bool:
    """Tuple order of the Python path's heap entries ``(load, worker)``: load first, then worker id."""
    return load < other_load or (load == other_load and worker < other_worker)


@njit("void(float64[::1], int64[::1], int64, float64, int64)", cache=True)
def _replace_top(loads, workers, size, load, worker):
    """heapq.heapreplace on a heap stored as two arrays. Only the minimum is ever read, and it is
    unique (worker ids differ), so the layout may differ from heapq's without changing any plan."""
    position = 0
    while True:
        child = 2 * position + 1
        if child >= size:
            break
        right = child + 1
        if right < size and _precedes(loads[right], workers[right], loads[child], workers[child]):
            child = right
        if not _precedes(loads[child], workers[child], load, worker):
            break
        loads[position] = loads[child]
        workers[position] = workers[child]
        position = child
    loads[position] = load
    workers[position] = worker


@njit("int64(int64[::1], float64, int64)", cache=True)
def _first_shorter(lengths, cutoff, start):
    """First rank >= ``start`` whose length is below ``cutoff`` (lengths descend): the Python path's
    ``bisect_right(negated, -cutoff, start)``, as negation is exact."""
    low, high = start, lengths.shape[0]
    while low < high:
        middle = (low + high) // 2
        if lengths[middle] < cutoff:
            high = middle
        else:
            low = middle + 1
    return low


@njit("float64(float64, int64, float64)", cache=True)
def _home_time(home_queue, remaining, home_fixed):
    # worker_time(Q_c if it computes anything, remaining, d(c->c) = 0, fixed), same operation order
    return (home_queue if remaining != 0 else 0.0) + remaining + 0.0 * remaining + home_fixed


@njit(cache=True)
def _plan_home(home, column, dispatch, queue, homes, lengths, fixed, sending, bound, floor, combine_queues, lead,
               computed, heap_loads, heap_workers, moved):
    """Greedy moves for one home, writing the worker of each cold segment (by rank) into ``moved``.

    Returns max_w T_w, or a value above ``bound`` (with ``moved`` incomplete) once the home cannot end
    at or below it, exactly as ``GreedyPlanner._plan_home``.
    """
    workers = queue.shape[0]
    home_fixed = fixed[home]
    # Idle workers contribute T_w = 0 (as in the estimate), so starting at 0.0 matches the Python
    # path's max over source workers with default 0.0: transfer costs are never negative.
    others = 0.0
    for worker in range(workers):
        if worker != home and sending[worker] and fixed[worker] > others:
            others = fixed[worker]
    if floor > others:  # the Python path's max(others, floor)
        others = floor
    if others > bound:
        return others
    remaining = 0
    for rank in range(lengths.shape[0]):
        remaining += lengths[rank]
        moved[rank] = home
    home_queue = queue[home]
    if combine_queues:  # the Python path: the combine waits for the home's queue, a fixed part of its term
        home_fixed = home_fixed + home_queue
        home_queue = 0.0
    home_fixed = home_fixed + lead
    home_time = _home_time(home_queue, remaining, home_fixed)
    size = 0  # the other workers by load: a sorted array is a valid heap
    for worker in homes:
        if worker != home:
            heap_loads[size] = queue[worker]
            heap_workers[size] = worker
            size += 1
    computed[:] = 0
    rank = 0
    count = lengths.shape[0] if size > 0 and home_time > others else 0
    while rank < count:
        length = lengths[rank]
        worker = heap_workers[0]
        mine = computed[worker]
        after = mine + length
        d = column[worker]
        target = queue[worker] + after + d * after + fixed[worker] + dispatch[worker]
        if target < home_time:
            computed[worker] = after
            moved[rank] = worker
            remaining -= length
            home_time = _home_time(home_queue, remaining, home_fixed)
            if target > others:
                others = target
                if others > bound:
                    return others
            if home_time <= others:
                break  # the maximum is now elsewhere: no later move can lower it
            _replace_top(heap_loads, heap_workers, size, queue[worker] + after, worker)
            rank += 1
            continue
        # Rejected: nothing changed, so skip every segment at least as long as the limit.
        slack = home_time - ((queue[worker] + mine + d * mine + fixed[worker]) + dispatch[worker])
        limit = slack / (1.0 + d)
        rank = _first_shorter(lengths, limit + abs(limit) * 1e-9 + 1e-9, rank + 1)
    return others if others > home_time else home_time  # builtin max(home_time, others)


@njit(PLAN_HOMES_SIGNATURE, cache=True)
def plan_homes(to, latency, dispatch, queue, homes, candidates, lengths, tokens, extra, wait, floor, combine_queues,
               lead):
    """Run the greedy for every home of ``candidates``, least loaded first, pruning against the best estimate so
    far.

    ``to[c, w]`` is d(w -> c); ``tokens[r, w]`` and ``extra[r, w]`` are what worker w supplies from
    cache and its slow-tier read cost, with one row per home (r = c) or a single row shared by all.
    ``latency[c, w]`` is added to w's fixed cost: paid by a source, and by a worker once it computes for c;
    ``wait[w]`` too, when w is a source other than the home (``PlanningProblem.source_wait``);
    ``dispatch[c, w]`` is added to w's time once it computes for c. ``floor`` is F, the shared processors' time
    for all the work (``TransferCosts.work_floor``): a lower bound on every home's estimate.
    ``homes`` may leave workers out (down ones): they are neither home nor helper. ``candidates`` (some of
    ``homes``) are the homes tried; the others only help. ``combine_queues``: the home's queue counts in its term
    even when it computes nothing (``TransferCosts.combine_queues``). ``lead``: tokens the home prefills while it
    waits for remote KV, in its term (``PlanningProblem.lead``).
    Returns per-home estimates (pruned homes: some value above the final best; homes not tried: infinity) and
    per-home cold assignments by rank, complete only for homes that were tried and not pruned.
    """
    workers, segments = queue.shape[0], lengths.shape[0]
    estimates = np.full(workers, np.inf)  # workers not in ``homes`` (down) stay at infinity
    moved = np.empty((workers, segments), np.int64)
    fixed = np.empty(workers)
    sending = np.empty(workers, np.bool_)
    computed = np.empty(workers, np.int64)
    heap_loads = np.empty(workers)
    heap_workers = np.empty(workers, np.int64)
    best = np.inf
    for home in candidates:
        row = 0 if tokens.shape[0] == 1 else home
        column = to[home]
        for worker in range(workers):
            # fixed_transfer: d(w->c) * tokens w sends + its slow-tier read cost + the link's latency; a worker
            # that sends nothing from cache pays the latency once it computes for c (the Python path's default)
            sending[worker] = tokens[row, worker] != 0
            fixed[worker] = column[worker] * tokens[row, worker] + extra[row, worker] + latency[home, worker] \
                + (wait[worker] if worker != home and sending[worker] else 0.0)
        estimate = _plan_home(home, column, dispatch[home], queue, homes, lengths, fixed, sending, best, floor,
                              combine_queues, lead, computed, heap_loads, heap_workers, moved[home])
        estimates[home] = estimate
        if estimate < best:
            best = estimate
    return estimates, moved

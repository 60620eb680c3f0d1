import logging
import math
import random
import sys
from dataclasses import replace

import pytest

from nebula_engine.cluster.control.config import ClusterProfile
from nebula_engine.cluster.control.messages import Tier
from nebula_engine.cluster.control.planner import (GreedyPlanner, Hit, PlanningProblem, TransferCosts,
                                           compiled_kernel, estimate, hit_source, hit_tokens_by_source,
                                           readable_copies, summarise, supplied_by_source)
from reference_planner import reference_plan


def uniform_costs(workers: int, d: float, host: float = 0.5) -> TransferCosts:
    return TransferCosts([[0.0 if w == c else d for w in range(workers)] for c in range(workers)],
                         {Tier.HOST: host})


def random_problem(rng: random.Random, workers: int, segments: int) -> PlanningProblem:
    hits, cold = [], []
    for _ in range(segments):
        length = rng.randint(1, 60)
        if rng.random() < 0.5:
            holders = rng.sample(range(workers), rng.randint(1, min(3, workers)))
            hits.append(Hit(length, tuple((w, Tier.HOST if rng.random() < 0.2 else Tier.DEVICE)
                                          for w in holders)))
        else:
            cold.append(length)
    queue = tuple(rng.choice([0.0, float(rng.randint(0, 90)), rng.random() * 90]) for _ in range(workers))
    return PlanningProblem(tuple(hits), tuple(cold), queue, rng.random() * 20)


@pytest.mark.parametrize("seed", range(400))
def test_fast_planner_matches_literal_algorithm_1(seed):
    rng = random.Random(seed)
    workers = rng.randint(1, 6)
    to = [[0.0 if w == c else rng.choice([0.02, 0.4, 1.5, rng.random()]) for w in range(workers)]
          for c in range(workers)]
    costs = TransferCosts(to, {Tier.HOST: rng.random()})
    problem = random_problem(rng, workers, rng.randint(0, 14))
    assert GreedyPlanner(costs, seed).plan(problem) == reference_plan(problem, costs, random.Random(seed))


def test_estimate_terms():
    costs = uniform_costs(3, d=0.5)
    problem = PlanningProblem(hits=(Hit(100, ((2, Tier.DEVICE),)),), cold=(40, 60),
                              outstanding=(10.0, 1000.0, 5.0), combine_cost=7.0)
    # home 0 computes 40 (queue 10 applies), worker 1 computes 60 and sends it, worker 2 sends 100
    value = estimate(problem, 0, [0, 1], [2], costs)
    assert value == max(10 + 40, 1000 + 60 + 0.5 * 60, 0.5 * 100) + 7.0
    # an idle worker's queue does not count
    assert estimate(problem, 0, [0, 0], [2], costs) == max(10 + 100, 50.0) + 7.0


def test_move_accepted_only_when_estimate_drops():
    # Moving the cold segment off the busy home would cost more in transfer than it saves.
    costs = uniform_costs(2, d=3.0)
    problem = PlanningProblem((), cold=(100,), outstanding=(0.0, 0.0), combine_cost=0.0)
    plan = GreedyPlanner(costs).plan(problem)
    assert plan.cold_workers == (plan.home,) and plan.estimate == 100.0
    # A move that leaves the estimate equal is not taken either.
    free = uniform_costs(2, d=0.0)
    equal = GreedyPlanner(free).plan(PlanningProblem((), (100,), (0.0, 0.0), 0.0))
    assert equal.cold_workers == (equal.home,)
    # With a cheap link, splitting two segments across two workers lowers the estimate.
    cheap = uniform_costs(2, d=0.1)
    split = GreedyPlanner(cheap).plan(PlanningProblem((), (100, 100), (0.0, 0.0), 0.0))
    assert sorted(split.cold_workers) == [0, 1] and split.estimate == pytest.approx(110.0)


def test_rejected_move_leaves_plan_unchanged_and_search_continues():
    # The long segment cannot move (target would exceed the home), a shorter one later can.
    costs = uniform_costs(2, d=0.0)
    problem = PlanningProblem((), cold=(90, 30, 20), outstanding=(0.0, 100.0), combine_cost=0.0)
    plan = GreedyPlanner(costs).plan(problem)
    reference = reference_plan(problem, costs, random.Random(0))
    assert plan == reference
    assert plan.estimate == estimate(problem, plan.home, plan.cold_workers, plan.hit_sources, costs)


def test_hits_stay_at_their_source():
    costs = uniform_costs(3, d=0.1)
    problem = PlanningProblem((Hit(500, ((1, Tier.DEVICE),)),), (), (0.0, 0.0, 0.0), 0.0)
    plan = GreedyPlanner(costs).plan(problem)
    assert plan.home == 1 and plan.hit_sources == (1,) and plan.estimate == 0.0


def test_ties_between_homes_broken_by_seeded_rng():
    costs = uniform_costs(8, d=0.1)
    problem = PlanningProblem((), (), (0.0,) * 8, 0.0)
    homes = {GreedyPlanner(costs, seed).plan(problem).home for seed in range(40)}
    assert len(homes) > 4
    assert GreedyPlanner(costs, 3).plan(problem) == GreedyPlanner(costs, 3).plan(problem)


def test_hit_source_prefers_home_then_cheapest_copy():
    costs = TransferCosts([[0.0, 0.2, 0.1], [0.2, 0.0, 0.3], [0.1, 0.3, 0.0]], {Tier.HOST: 0.5})
    hit = Hit(10, ((1, Tier.DEVICE), (2, Tier.DEVICE)))
    assert hit_source(hit, 1, costs) == 1
    assert hit_source(hit, 0, costs) == 2
    slow = Hit(10, ((1, Tier.DEVICE), (2, Tier.HOST)))
    assert hit_source(slow, 0, costs) == 1


def test_load_beats_recompute_on_slow_tier():
    costs = uniform_costs(2, d=0.1, host=0.5)
    assert costs.load_beats_recompute(Tier.HOST, 0, 1, 100)
    assert not uniform_costs(2, d=0.6, host=0.5).load_beats_recompute(Tier.HOST, 0, 1, 100)


def test_load_beats_recompute_pays_the_link_latency_once():
    costs = TransferCosts([[0.0, 0.1], [0.1, 0.0]], latency=[[0.0, 50.0], [50.0, 0.0]])
    assert not costs.load_beats_recompute(Tier.DEVICE, 0, 1, 50)  # 0.1 * 50 + 50 > 50
    assert costs.load_beats_recompute(Tier.DEVICE, 0, 1, 60)  # 0.1 * 60 + 50 < 60
    assert costs.load_beats_recompute(Tier.DEVICE, 1, 1, 1)  # its own copy


def test_readable_copies_pay_each_source_latency_once_and_move_a_dropped_source_segments_to_the_next_holder():
    d = [[0.0, 0.1, 0.2], [0.1, 0.0, 0.1], [0.2, 0.1, 0.0]]
    latency = [[0.0, 150.0, 150.0], [150.0, 0.0, 150.0], [150.0, 150.0, 0.0]]
    costs = TransferCosts(d, {Tier.HOST: 0.95}, latency=latency)
    device = Tier.DEVICE
    holders = {"x": ((1, device), (2, device)), "y": ((2, device),), "z": ((2, device),), "own": ((0, Tier.HOST),),
               "dear": ((2, Tier.HOST),)}
    length = {"x": 100, "y": 100, "z": 100, "own": 10, "dear": 500}
    # x is cheaper from worker 1, but 1 would send only x (90 saved < 150): x comes from 2 with y and z (240 > 150);
    # the home's own host copy has no latency; a copy dearer per token than recomputing is never read
    assert readable_copies(holders, length, 0, costs) == {
        "x": ((2, device),), "y": ((2, device),), "z": ((2, device),), "own": ((0, Tier.HOST),), "dear": ()}
    assert readable_copies({"y": ((2, device),)}, {"y": 100}, 0, costs) == {"y": ()}
    assert readable_copies({"y": ((2, device),)}, {"y": 100}, 2, costs) == {"y": ((2, device),)}


def test_transfer_costs_from_profile_follow_topology():
    profile = ClusterProfile.load()
    costs = TransferCosts.from_profile(profile, 7)
    assert costs.latency[0][0] == 0.0
    assert costs.latency[0][5] == pytest.approx(profile.inter_node.latency_s / profile.prefill.per_token_s)
    assert costs.to[0][0] == 0.0
    same_node, other_node = costs.to[0][1], costs.to[0][5]
    assert 0 < same_node < other_node < 1
    expected = profile.kv_bytes_per_token / profile.inter_node.bandwidth_bytes_per_s / profile.prefill.per_token_s
    assert other_node == pytest.approx(expected)


def random_costs(rng: random.Random, workers: int) -> TransferCosts:
    to = [[0.0 if w == c else rng.choice([0.02, 0.4, 1.5, rng.random()]) for w in range(workers)]
          for c in range(workers)]
    return TransferCosts(to, {Tier.HOST: rng.random()})


@pytest.mark.parametrize("seed", range(400))
def test_pure_python_loop_matches_literal_algorithm_1(seed):
    # The same cases as above, forcing the documented reference loop instead of the numba kernel.
    rng = random.Random(seed)
    workers = rng.randint(1, 6)
    costs = random_costs(rng, workers)
    problem = random_problem(rng, workers, rng.randint(0, 14))
    planner = GreedyPlanner(costs, seed, compiled=False)
    assert planner.kernel is None
    assert planner.plan(problem) == reference_plan(problem, costs, random.Random(seed))


def costs_with_latency(rng: random.Random, workers: int) -> TransferCosts:
    costs = random_costs(rng, workers)
    latency = [[0.0 if w == c else rng.choice([0.0, 5.0, 40.0, rng.random() * 100]) for w in range(workers)]
               for c in range(workers)]
    return TransferCosts(costs.to, {Tier.HOST: costs.tier_cost[Tier.HOST]}, latency)


def costs_with_dispatch(rng: random.Random, workers: int) -> TransferCosts:
    costs = costs_with_latency(rng, workers)
    dispatch = [[0.0 if w == c else rng.choice([0.0, 10.0, 60.0, rng.random() * 200]) for w in range(workers)]
                for c in range(workers)]
    return TransferCosts(costs.to, {Tier.HOST: costs.tier_cost[Tier.HOST]}, costs.latency, dispatch)


def costs_on_shared_cores(rng: random.Random, workers: int) -> TransferCosts:
    costs = costs_with_dispatch(rng, workers)
    return TransferCosts(costs.to, {Tier.HOST: costs.tier_cost[Tier.HOST]}, costs.latency, costs.dispatch,
                         parallel_forwards=rng.choice([1, 2, 3, 0.5 + 4 * rng.random()]))


def costs_with_combine_queues(rng: random.Random, workers: int) -> TransferCosts:
    costs = costs_on_shared_cores(rng, workers)
    return TransferCosts(costs.to, {Tier.HOST: costs.tier_cost[Tier.HOST]}, costs.latency, costs.dispatch,
                         costs.parallel_forwards, combine_queues=True)


@pytest.mark.parametrize("compiled", [None, False])
@pytest.mark.parametrize("seed", range(200))
@pytest.mark.parametrize("fixed_costs", [costs_with_latency, costs_with_dispatch, costs_on_shared_cores,
                                         costs_with_combine_queues])
def test_both_loops_match_literal_algorithm_1_with_latency_dispatch_and_shared_cores(fixed_costs, seed, compiled):
    rng = random.Random(seed)
    workers = rng.randint(1, 6)
    costs = fixed_costs(rng, workers)
    problem = random_problem(rng, workers, rng.randint(0, 14))
    assert GreedyPlanner(costs, seed, compiled=compiled).plan(problem) == \
        reference_plan(problem, costs, random.Random(seed))


@pytest.mark.parametrize("compiled", [None, False])
@pytest.mark.parametrize("seed", range(150))
@pytest.mark.parametrize("fixed_costs", [costs_with_dispatch, costs_on_shared_cores, costs_with_combine_queues])
def test_both_loops_match_literal_algorithm_1_with_a_lead_and_sources_that_wait(fixed_costs, seed, compiled):
    rng = random.Random(seed)
    workers = rng.randint(1, 6)
    costs = fixed_costs(rng, workers)
    problem = random_problem(rng, workers, rng.randint(0, 14))
    waits = tuple(rng.choice([0.0, 0.0, 30.0, rng.random() * 300]) for _ in range(workers)) if seed % 2 else ()
    problem = replace(problem, lead=rng.choice([0.0, problem.combine_cost * rng.random(), problem.combine_cost]),
                      source_wait=waits)
    plan = GreedyPlanner(costs, seed, compiled=compiled).plan(problem)
    assert plan == reference_plan(problem, costs, random.Random(seed))
    assert plan.estimate == estimate(problem, plan.home, plan.cold_workers, plan.hit_sources, costs)


@pytest.mark.parametrize("compiled", [None, False])
def test_a_lead_prefilled_while_the_home_waits_overlaps_the_helpers_and_loads_the_home(compiled):
    """The home prefills the prompt's lead (400 tokens of C) while remote KV is in flight. Counted after the wait,
    as §7.2 counts all of C, the lead makes no worker busier and a cold segment stays home (a helper's latency
    exceeds it); counted in the home's term, the home is the longest term and the segment goes to the idle
    helper, which ends before the lead does: the estimate falls by the overlap. With two shared cores the lead
    is also work in F."""
    costs = TransferCosts([[0.0, 0.01], [0.01, 0.0]], latency=[[0.0, 150.0], [150.0, 0.0]], combine_queues=True)
    problem = PlanningProblem((Hit(1000, ((0, Tier.DEVICE),)),), (100,), (0.0, 50.0), 500.0)
    planner = GreedyPlanner(costs, compiled=compiled)
    after_wait = planner.plan(problem)
    assert (after_wait.home, after_wait.cold_workers, after_wait.estimate) == (0, (0,), 600.0)
    overlapped = planner.plan(replace(problem, lead=400.0))
    assert (overlapped.home, overlapped.cold_workers) == (0, (1,))
    assert overlapped.estimate == pytest.approx(400.0 + 100.0)  # max(lead, 50 + 150 + 101) + the 100 left of C
    shared = TransferCosts(costs.to, latency=costs.latency, parallel_forwards=2, combine_queues=True)
    assert costs.work_floor(replace(problem, lead=400.0)) == 0.0
    assert shared.work_floor(replace(problem, lead=400.0)) == (50 + 100 + 400) / 2


@pytest.mark.parametrize("compiled", [None, False])
def test_shared_cores_spread_cold_segments_only_while_cores_are_free(compiled):
    def plan(queue, parallel_forwards):
        costs = TransferCosts([[0.0 if w == c else 0.01 for w in range(4)] for c in range(4)],
                              parallel_forwards=parallel_forwards)
        return GreedyPlanner(costs, compiled=compiled).plan(PlanningProblem((), (100,) * 4, queue, 0.0))

    idle, busy = (0.0,) * 4, (300.0,) * 4
    assert len(set(plan(idle, math.inf).cold_workers)) == 4  # own processors: one segment each
    # two cores: the machine needs 400 / 2 whoever computes; the greedy stops moving once the home is down to it
    assert len(set(plan(idle, 2).cold_workers)) < 4 and plan(idle, 2).estimate == 200
    spread = plan(busy, math.inf)
    assert len(set(spread.cold_workers)) == 4 and spread.estimate == 300 + 100 + 1
    # every worker busy on two shared cores: the machine needs (4 * 300 + 400) / 2 whoever computes
    kept = plan(busy, 2)
    assert set(kept.cold_workers) == {kept.home} and kept.estimate == 800
    assert estimate(PlanningProblem((), (100,) * 4, busy, 0.0), 0, [0, 1, 2, 3], [],
                    TransferCosts([[0.0, 0.01, 0.01, 0.01]] * 4, parallel_forwards=2)) == 800
    with pytest.raises(ValueError, match="parallel_forwards"):
        TransferCosts([[0.0]], parallel_forwards=0)


def test_profile_shared_compute_sets_parallel_forwards_per_node():
    profile = ClusterProfile.load()
    assert not profile.shared_compute  # shipped profiles: one GPU per worker, no floor
    assert math.isinf(TransferCosts.from_profile(profile, 4).parallel_forwards)
    shared = replace(profile, shared_compute=True, node_cores=2.0, gpus_per_node=4)
    assert TransferCosts.from_profile(shared, 4).parallel_forwards == 2.0
    assert TransferCosts.from_profile(shared, 8).parallel_forwards == 4.0  # two nodes of two cores


def test_link_latency_keeps_short_segments_at_the_home_and_still_spreads_long_ones():
    def plan(cold, latency):
        costs = TransferCosts([[0.0, 0.01], [0.01, 0.0]], latency=[[0.0, latency], [latency, 0.0]])
        return GreedyPlanner(costs, compiled=False).plan(PlanningProblem((), cold, (0.0, 0.0), 0.0))

    assert set(plan((30, 30), latency=0.0).cold_workers) == {0, 1}  # Algorithm 1 splits them
    assert set(plan((30, 30), latency=40.0).cold_workers) == {plan((30, 30), latency=40.0).home}
    assert set(plan((300, 300), latency=40.0).cold_workers) == {0, 1}  # worth a round trip
    # a source pays its link's latency once, whatever it sends
    hit = PlanningProblem((Hit(20, ((1, Tier.DEVICE),)),), (200,), (0.0, 0.0), 0.0)
    costs = TransferCosts([[0.0, 0.01], [0.01, 0.0]], latency=[[0.0, 40.0], [40.0, 0.0]])
    assert estimate(hit, 0, [0], [1], costs) == max(200, 0.01 * 20 + 40.0)


def test_dispatch_is_paid_by_a_worker_computing_for_another_home_not_by_a_source():
    def costs(dispatch):
        return TransferCosts([[0.0, 0.01], [0.01, 0.0]], latency=[[0.0, 10.0], [10.0, 0.0]],
                             dispatch=[[0.0, dispatch], [dispatch, 0.0]])

    def plan(cold, dispatch):
        return GreedyPlanner(costs(dispatch), compiled=False).plan(PlanningProblem((), cold, (0.0, 0.0), 0.0))

    assert set(plan((100, 100), dispatch=0.0).cold_workers) == {0, 1}  # latency alone: worth splitting
    assert len(set(plan((100, 100), dispatch=120.0).cold_workers)) == 1  # the dispatch wait outweighs it
    assert set(plan((400, 400), dispatch=120.0).cold_workers) == {0, 1}
    # worker 1 only sends its cached copy: latency, no dispatch; once it computes too, both
    hit = PlanningProblem((Hit(20, ((1, Tier.DEVICE),)),), (200,), (0.0, 0.0), 0.0)
    assert estimate(hit, 0, [0], [1], costs(120.0)) == max(200, 0.01 * 20 + 10.0)
    assert estimate(hit, 0, [1], [1], costs(120.0)) == 200 + 0.01 * 200 + 0.01 * 20 + 10.0 + 120.0
    with pytest.raises(ValueError, match="dispatch"):
        TransferCosts([[0.0]], dispatch=[[5.0]])


def test_profile_dispatch_in_prefill_tokens():
    profile = ClusterProfile.load()
    assert profile.dispatch_s == 0.0  # the paper's model: shipped profiles have none
    scattered = replace(profile, dispatch_s=0.1)
    costs = TransferCosts.from_profile(scattered, 2)
    assert costs.dispatch[0][0] == 0.0
    assert costs.dispatch[0][1] == pytest.approx(0.1 / profile.prefill.per_token_s)


def large_problem(rng: random.Random, workers: int, segments: int, tied_loads: bool) -> PlanningProblem:
    """Benchmark-sized (too big for the literal algorithm): multi-copy and slow-tier hits, and
    optionally equal loads everywhere so that many homes tie and the RNG decides."""
    base = random_problem(rng, workers, segments)
    hits = tuple(Hit(hit.num_tokens * 40, hit.holders) for hit in base.hits)
    cold = tuple(length * 40 for length in base.cold)
    queue = (0.0,) * workers if tied_loads else tuple(q * 90 for q in base.outstanding)
    return PlanningProblem(hits, cold, queue, base.combine_cost)


@pytest.mark.parametrize("workers, segments", [(16, 256), (256, 16), (40, 40), (2, 64)])
def test_compiled_kernel_matches_python_loop_at_scale(workers, segments):
    pytest.importorskip("numba")
    rng = random.Random(workers * 1000 + segments)
    costs = random_costs(rng, workers)
    compiled, python = GreedyPlanner(costs, 7), GreedyPlanner(costs, 7, compiled=False)
    assert compiled.kernel is not None  # numba present: the kernel is the default
    # One planner per path over a sequence of problems, so the RNG must be consumed identically too.
    for index in range(12):
        problem = large_problem(rng, workers, segments, tied_loads=index % 3 == 0)
        assert compiled.plan(problem) == python.plan(problem)


@pytest.mark.parametrize("seed", range(20))
def test_supplied_by_source_matches_summarise(seed):
    rng = random.Random(seed)
    workers = rng.randint(1, 8)
    costs = random_costs(rng, workers)
    hits = random_problem(rng, workers, 30).hits
    tokens, extra = supplied_by_source(hits, costs)
    multi = any(len(hit.holders) > 1 for hit in hits)
    assert tokens.shape == extra.shape == (workers if multi else 1, workers)
    for home in range(workers):
        row = home if multi else 0
        expected = summarise(hit_tokens_by_source(hits, home, costs), costs)
        for worker in range(workers):
            sent, cost = expected.get(worker, (0, 0.0))
            assert (tokens[row, worker], extra[row, worker]) == (sent, cost)


def test_missing_numba_warns_and_falls_back_to_python(monkeypatch, caplog):
    import nebula_engine.cluster.control as cluster_package

    costs = uniform_costs(3, d=0.1)
    problem = PlanningProblem((Hit(50, ((1, Tier.HOST),)),), (300, 200, 100), (0.0, 10.0, 20.0), 0.0)
    expected = reference_plan(problem, costs, random.Random(0))
    compiled_kernel.cache_clear()
    try:
        monkeypatch.setitem(sys.modules, "numba", None)  # makes `import numba` raise ImportError
        monkeypatch.delitem(sys.modules, "nebula_engine.cluster.control.planner_kernel", raising=False)
        monkeypatch.delattr(cluster_package, "planner_kernel", raising=False)
        with caplog.at_level(logging.WARNING, logger="nebula_engine.cluster.control.planner"):
            planner = GreedyPlanner(costs)
        assert planner.kernel is None
        assert "pure-Python" in caplog.text and "numba" in caplog.text
        assert planner.plan(problem) == expected
        with pytest.raises(RuntimeError, match="numba"):
            GreedyPlanner(costs, compiled=True)
    finally:
        monkeypatch.undo()
        compiled_kernel.cache_clear()  # later planners load the real kernel again


@pytest.mark.parametrize("compiled", [None, False])
@pytest.mark.parametrize("parallel_forwards", [math.inf, 2])
def test_a_worker_that_is_down_is_neither_home_nor_helper(compiled, parallel_forwards):
    costs = TransferCosts([[0.0 if w == c else 0.01 for w in range(4)] for c in range(4)],
                          parallel_forwards=parallel_forwards)
    for seed in range(20):  # ties between homes are broken at random: every draw avoids the down worker
        planner = GreedyPlanner(costs, seed, compiled=compiled)
        plan = planner.plan(PlanningProblem((Hit(30, ((2, Tier.DEVICE),)),), (100,) * 4, (0.0, math.inf, 0.0, 0.0),
                                            0.0))
        assert plan.home != 1 and 1 not in plan.cold_workers and math.isfinite(plan.estimate)
        # nothing cold: the home's queue would not count, yet a down worker is still no home
        assert planner.plan(PlanningProblem((), (), (math.inf, 0.0), 0.0)).home == 1
    # its queue is no work for the shared cores: the floor of three idle workers, 400 / 2
    if parallel_forwards == 2:
        assert GreedyPlanner(costs, compiled=compiled).plan(
            PlanningProblem((), (100,) * 4, (0.0, math.inf, 0.0, 0.0), 0.0)).estimate == 200
    with pytest.raises(ValueError, match="every prefill worker is down"):
        GreedyPlanner(costs, compiled=compiled).plan(PlanningProblem((), (100,), (math.inf,) * 4, 0.0))


@pytest.mark.parametrize("seed", range(100))
def test_a_plan_restricted_to_one_home_is_that_homes_best_in_both_loops(seed):
    """``plan(problem, homes=(h,))`` keeps h as the home and lets every worker help; the best of those over all
    homes is the unrestricted plan's estimate."""
    rng = random.Random(seed)
    workers = rng.randint(1, 6)
    costs = costs_on_shared_cores(rng, workers)
    problem = random_problem(rng, workers, rng.randint(0, 14))
    unrestricted = GreedyPlanner(costs, seed).plan(problem)
    estimates = []
    for home in range(workers):
        python = GreedyPlanner(costs, seed, compiled=False).plan(problem, homes=(home,))
        assert python == GreedyPlanner(costs, seed).plan(problem, homes=(home,))
        assert python.home == home
        assert python.estimate == pytest.approx(estimate(problem, home, python.cold_workers, python.hit_sources,
                                                         costs))
        estimates.append(python.estimate)
    assert min(estimates) == unrestricted.estimate


def test_a_home_that_is_down_cannot_be_asked_for():
    problem = PlanningProblem((), (50,), (0.0, math.inf), 10.0)
    with pytest.raises(ValueError, match="must be workers that are up"):
        GreedyPlanner(uniform_costs(2, 0.1)).plan(problem, homes=(1,))


@pytest.mark.parametrize("compiled", [None, False])
def test_a_home_whose_combine_waits_for_its_queue_is_not_free_when_it_scatters_everything(compiled):
    """§7.2 gives a ready combine priority, so a busy home that sends every cold segment elsewhere costs nothing
    there; where a combine waits behind its home's queue (``combine_queues``), the idle worker is the home."""
    to = [[0.0, 0.1], [0.1, 0.0]]
    problem = PlanningProblem((Hit(10_000, ((0, Tier.DEVICE),)),), (300, 300), (1500.0, 0.0), 10.0)
    paper = GreedyPlanner(TransferCosts(to), compiled=compiled).plan(problem)
    assert paper.home == 0 and paper.cold_workers == (1, 1)
    queued = GreedyPlanner(TransferCosts(to, combine_queues=True), compiled=compiled).plan(problem)
    assert queued.home == 1 and queued.hit_sources == (0,)
    assert queued.estimate == pytest.approx(estimate(problem, 1, queued.cold_workers, queued.hit_sources,
                                                     TransferCosts(to, combine_queues=True)))


@pytest.mark.parametrize("compiled", [None, False])
def test_homes_tied_by_the_shared_cores_floor_go_to_the_least_loaded(compiled):
    # two shared cores, one worker with 300 tokens queued: F = (300 + 1,000) / 2 = 650 exceeds every home's own
    # term, so every home estimates 650. Before, the RNG could put the combine behind the 300 queued tokens.
    costs = TransferCosts([[0.0 if w == c else 0.01 for w in range(3)] for c in range(3)], parallel_forwards=2,
                          combine_queues=True)
    problem = PlanningProblem((), (500, 500), (300.0, 0.0, 0.0), 0.0)
    plans = [GreedyPlanner(costs, seed, compiled=compiled).plan(problem) for seed in range(40)]
    assert {p.estimate for p in plans} == {650.0}
    assert {p.home for p in plans} == {1, 2}  # both idle homes still drawn at random


@pytest.mark.parametrize("compiled", [None, False])
def test_a_source_whose_copy_is_not_computed_yet_adds_its_wait_and_the_home_its_own_does_not(compiled):
    """Worker 1 will hold a 300-token copy once it has worked 500 tokens: read from there, the combine at home 0
    starts after that wait; the home with the copy (1) reads its own and waits only for its queue."""
    costs = TransferCosts([[0.0, 0.01], [0.01, 0.0]], combine_queues=True)
    problem = PlanningProblem((Hit(300, ((1, Tier.DEVICE),)),), (), (0.0, 500.0), 100.0, source_wait=(0.0, 500.0))
    assert estimate(problem, 0, [], [1], costs) == 500.0 + 0.01 * 300 + 100.0
    assert estimate(replace(problem, source_wait=()), 0, [], [1], costs) == 0.01 * 300 + 100.0
    assert estimate(problem, 1, [], [1], costs) == 500.0 + 100.0  # its queue, not the wait on top
    assert GreedyPlanner(costs, compiled=compiled).plan(problem).home == 1


def test_source_wait_is_one_non_negative_entry_per_worker():
    with pytest.raises(ValueError, match="2 workers"):
        PlanningProblem((), (), (0.0, 0.0), 0.0, source_wait=(1.0,))
    with pytest.raises(ValueError, match="non-negative"):
        PlanningProblem((), (), (0.0, 0.0), 0.0, source_wait=(0.0, -1.0))


def test_readable_copies_drop_a_copy_whose_wait_exceeds_its_saving_unless_the_home_queue_covers_it():
    """A 200-token copy at worker 1 exists only after 400 tokens of its queue: recomputing it at the home costs
    200, so a free home recomputes; a home whose combine waits behind 350 tokens anyway loses only 50 to the wait
    and reads it; one whose combine does not queue (§7.2) pays the whole wait."""
    device = Tier.DEVICE
    queued = TransferCosts([[0.0, 0.01], [0.01, 0.0]], latency=[[0.0, 10.0], [10.0, 0.0]], combine_queues=True)
    holders, length, wait = {"s": ((1, device),)}, {"s": 200}, {"s": 400.0}
    assert readable_copies(holders, length, 0, queued) == holders  # no wait known: a plain copy
    assert readable_copies(holders, length, 0, queued, wait, home_queue=0.0) == {"s": ()}
    assert readable_copies(holders, length, 0, queued, wait, home_queue=350.0) == holders
    assert readable_copies(holders, length, 1, queued, wait) == holders  # the home's own copy
    paper = TransferCosts(queued.to, latency=queued.latency)
    assert readable_copies(holders, length, 0, paper, wait, home_queue=350.0) == {"s": ()}

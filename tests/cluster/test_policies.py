import math
from dataclasses import replace

import pytest

from builders import rag_requests, request
from nebula_engine.cluster.control.config import ClusterConfig
from nebula_engine.cluster.control.control_plane import ControlPlane
from nebula_engine.cluster.control.messages import (Action, CacheKind, DoneEvent, LeadPlan, PrefillPlan, PrefixPlan,
                                                    SegmentPlan, StoreEvent, Tier)
from nebula_engine.cluster.control.planner import Hit, PlanningProblem, TransferCosts
from nebula_engine.cluster.control.policies import POLICIES, default_cache, make_policy, view_config
from nebula_engine.cluster.control.request_keys import RequestKeys
from nebula_engine.cluster.control.schedulers import SCHEDULERS, LoadScheduler, LocalityScheduler

CONFIG = ClusterConfig(num_prefill_workers=4)


def store_all(plane: ControlPlane, worker: int, kind: CacheKind, keys, start_seq: int = 0) -> None:
    for seq, key in enumerate(keys, start=start_seq):
        plane.on_event(StoreEvent(worker, seq, kind, (key,), 100), now=0.0)


def rag_request():
    return request("r", ("P", "sys", 100), ("I", "doc-a", 100), ("I", "doc-b", 100), ("R", "q", 10))


def test_registry_names():
    assert set(POLICIES) == {"pc", "local-pic", "nebula"}
    assert set(SCHEDULERS) == {"greedy", "locality", "load"}
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope", CONFIG, TransferCosts.from_profile(CONFIG.profile, 4))
    with pytest.raises(ValueError, match="unknown view"):
        view_config("nope", CONFIG)


def test_pc_routes_to_longest_prefix_holder_and_ignores_pic():
    plane = ControlPlane(CONFIG, "pc")
    keys = RequestKeys.of(rag_request())
    store_all(plane, 2, CacheKind.PC, keys.pc_keys[:2])
    store_all(plane, 1, CacheKind.PIC, ["doc-b"])
    plan = plane.on_request(keys, now=1.0).plan
    assert plan.combine_home == 2 and plan.prefix.num_segments == 2 and plan.segments == ()
    assert plan.combine_tokens == 110


def test_local_pic_marks_pic_segments_local_at_home():
    plane = ControlPlane(CONFIG, "local-pic")
    keys = RequestKeys.of(rag_request())
    store_all(plane, 3, CacheKind.PC, keys.pc_keys[:1])
    plan = plane.on_request(keys, now=1.0).plan
    assert plan.combine_home == 3
    assert [(s.index, s.action, s.worker) for s in plan.segments] == [(1, Action.LOCAL, 3), (2, Action.LOCAL, 3)]


def test_nebula_reuses_remote_pic_and_records_dispatch():
    plane = ControlPlane(CONFIG, "nebula")
    keys = RequestKeys.of(rag_request())
    store_all(plane, 1, CacheKind.PIC, ["doc-a"])
    plan = plane.on_request(keys, now=1.0).plan
    actions = {s.key: (s.action, s.worker) for s in plan.segments}
    assert actions["doc-a"] == (Action.REUSE, 1)
    assert actions["doc-b"][0] is Action.COMPUTE
    # optimistic record of the cold segment and of the home's prefix chain
    assert actions["doc-b"][1] in plane.view.holders(CacheKind.PIC, "doc-b", now=1.0)
    assert plan.combine_home in plane.view.holders(CacheKind.PC, keys.pc_keys[-1], now=1.0)
    # combine = regular tokens + recompute share of the PIC segments
    assert plan.combine_tokens == pytest.approx(110 + CONFIG.profile.combine_ratio * 200)


def test_nebula_second_request_awaits_in_flight_segment():
    plane = ControlPlane(CONFIG, "nebula")
    first = plane.on_request(RequestKeys.of(rag_request()), now=0.0).plan
    second = plane.on_request(RequestKeys.of(request("r2", ("I", "doc-b", 100))), now=0.1).plan
    computed_at = next(s.worker for s in first.segments if s.key == "doc-b")
    assert second.segments[0].action is Action.REUSE and second.segments[0].worker == computed_at


def test_event_view_recomputes_in_flight_segment():
    plane = ControlPlane(CONFIG, "nebula", view="event")
    plane.on_request(RequestKeys.of(rag_request()), now=0.0)
    second = plane.on_request(RequestKeys.of(request("r2", ("I", "doc-b", 100))), now=0.1).plan
    assert second.segments[0].action is Action.COMPUTE


def test_locality_scheduler_picks_most_local_hits():
    costs = TransferCosts.from_profile(CONFIG.profile, 4)
    problem = PlanningProblem((Hit(100, ((1, Tier.DEVICE),)), Hit(300, ((2, Tier.DEVICE),))), (50, 60),
                              (0.0, 0.0, 9999.0, 0.0), 10.0)
    plan = LocalityScheduler(costs).place(problem)
    assert plan.home == 2 and plan.cold_workers == (2, 2)


def test_load_scheduler_is_lpt():
    costs = TransferCosts.from_profile(CONFIG.profile, 3)
    problem = PlanningProblem((), (50, 300, 100), (0.0, 10.0, 20.0), 200.0)
    plan = LoadScheduler(costs).place(problem)
    # 300 -> w0 (0), 200 (combine) -> w1 (10), 100 -> w2 (20), 50 -> w2 (120)
    assert plan.cold_workers == (2, 0, 2) and plan.home == 1


def test_decision_carries_new_share_at_window_end():
    plane = ControlPlane(CONFIG, "nebula")
    shares = [plane.on_request(RequestKeys.of(request(f"r{i}", ("I", f"d{i}", 10))), now=i).pc_share
              for i in range(16)]
    assert shares[:15] == [None] * 15 and shares[15] == 0.5


def test_nebula_places_a_repeated_segment_once():
    plane = ControlPlane(CONFIG, "nebula")
    keys = RequestKeys.of(request("r", ("I", "doc", 100), ("R", "q", 5), ("I", "doc", 100)))
    plan = plane.on_request(keys, now=0.0).plan
    first, again = plan.segments
    assert first.action is Action.COMPUTE and again.action is Action.REUSE
    assert again.worker == first.worker and again.index == 2


def test_nebula_plans_no_extra_reuse_for_a_repeat_inside_the_prefix_hit():
    """Defect 1: the earlier copy of a repeated segment lies inside the prefix hit; only the later copy is planned."""
    plane = ControlPlane(CONFIG, "nebula")
    keys = RequestKeys.of(request("r", ("P", "sys", 50), ("I", "doc", 100), ("R", "q", 5), ("I", "doc", 100)))
    store_all(plane, 2, CacheKind.PC, keys.pc_keys[:2])  # worker 2 holds sys + doc as a prefix
    plan = plane.on_request(keys, now=1.0).plan
    assert plan.prefix.num_segments == 2
    assert [(s.index, s.action) for s in plan.segments] == [(3, Action.COMPUTE)]


def slow_tier_plane(d: float, host: float) -> ControlPlane:
    """Two workers d apart: worker 1 holds "doc" on its host tier, worker 0 a long "big" on its device, which
    makes worker 0 the home."""
    costs = TransferCosts([[0.0, d], [d, 0.0]], {Tier.HOST: host})
    plane = ControlPlane(ClusterConfig(num_prefill_workers=2), "nebula", costs=costs)
    plane.on_event(StoreEvent(1, 1, CacheKind.PIC, ("doc",), 100, Tier.HOST), now=0.0)
    plane.on_event(StoreEvent(0, 1, CacheKind.PIC, ("big",), 1000), now=0.0)
    return plane


SLOW_TIER_KEYS = RequestKeys.of(request("r", ("I", "big", 1000), ("I", "doc", 100), ("R", "q", 5)))


def test_slow_tier_copy_is_read_only_when_loading_and_moving_it_beats_recompute():
    """Defect 3: the load-vs-recompute check counts the network to the chosen home, not just the tier."""
    cheap = slow_tier_plane(d=0.1, host=0.5).on_request(SLOW_TIER_KEYS, now=1.0).plan
    assert cheap.combine_home == 0
    assert [(s.action, s.worker, s.tier) for s in cheap.segments if s.key == "doc"] == [(Action.REUSE, 1, Tier.HOST)]
    dear = slow_tier_plane(d=0.6, host=0.5).on_request(SLOW_TIER_KEYS, now=1.0).plan  # 0.5 + 0.6 >= 1
    assert dear.combine_home == 0
    assert [(s.action, s.worker) for s in dear.segments if s.key == "doc"] == [(Action.COMPUTE, 0)]


def test_a_short_device_copy_behind_a_slow_link_is_recomputed_at_the_home():
    """A device copy costs the link's latency once: not worth it for a segment shorter than that."""
    latency = [[0.0, 150.0], [150.0, 0.0]]
    for doc_tokens, action in ((100, Action.COMPUTE), (400, Action.REUSE)):
        plane = ControlPlane(ClusterConfig(num_prefill_workers=2), "nebula",
                             costs=TransferCosts([[0.0, 0.1], [0.1, 0.0]], latency=latency))
        plane.on_event(StoreEvent(1, 1, CacheKind.PIC, ("doc",), doc_tokens), now=0.0)
        plane.on_event(StoreEvent(0, 1, CacheKind.PIC, ("big",), 1000), now=0.0)
        keys = RequestKeys.of(request("r", ("I", "big", 1000), ("I", "doc", doc_tokens), ("R", "q", 5)))
        plan = plane.on_request(keys, now=1.0).plan
        assert plan.combine_home == 0
        assert [s.action for s in plan.segments if s.key == "doc"] == [action]


def test_short_copies_on_one_source_are_read_when_together_they_pay_its_latency_once():
    """The link's latency is paid once per source, not once per segment: two 100-token documents behind a 150-token
    latency are each not worth a read, but read together from one holder they save 180 tokens for 150 (before, each
    was judged alone and both were recomputed). A lone one on another holder is still recomputed."""
    latency = [[0.0, 150.0, 150.0], [150.0, 0.0, 150.0], [150.0, 150.0, 0.0]]
    d = [[0.0, 0.1, 0.1], [0.1, 0.0, 0.1], [0.1, 0.1, 0.0]]
    keys = RequestKeys.of(request("r", ("I", "big", 1000), ("I", "doc-a", 100), ("I", "doc-b", 100),
                                  ("I", "doc-c", 100), ("R", "q", 5)))
    for home in (None, 0):  # planned by the policy, and with the home pinned
        plane = ControlPlane(ClusterConfig(num_prefill_workers=3), "nebula", costs=TransferCosts(d, latency=latency))
        store_all(plane, 1, CacheKind.PIC, ("doc-a", "doc-b"), start_seq=1)
        plane.on_event(StoreEvent(2, 1, CacheKind.PIC, ("doc-c",), 100), now=0.0)
        plane.on_event(StoreEvent(0, 1, CacheKind.PIC, ("big",), 1000), now=0.0)
        plan = plane.on_request(keys, now=1.0, home=home).plan
        assert plan.combine_home == 0
        assert {s.key: (s.action, s.worker) for s in plan.segments} == {
            "big": (Action.REUSE, 0), "doc-a": (Action.REUSE, 1), "doc-b": (Action.REUSE, 1),
            "doc-c": (Action.COMPUTE, 0)}


def expected_copy_plane(expected_copies_wait: bool) -> ControlPlane:
    """Three workers; worker 0 holds a big document (so it is the home); worker 1 was just sent a 300-token document
    to prefill behind 2,000 tokens of earlier work: the view expects it there, not stored yet."""
    d = [[0.0 if w == c else 0.01 for w in range(3)] for c in range(3)]
    latency = [[0.0 if w == c else 20.0 for w in range(3)] for c in range(3)]
    costs = TransferCosts(d, latency=latency, combine_queues=True, expected_copies_wait=expected_copies_wait)
    plane = ControlPlane(ClusterConfig(num_prefill_workers=3), "nebula", costs=costs)
    plane.on_event(StoreEvent(0, 1, CacheKind.PIC, ("big",), 1000), now=0.0)
    plane.view.reserve("earlier", 1, 2000.0)
    computing = SegmentPlan(0, "doc", 300, 1, Action.COMPUTE, task_id="first/s0")
    plane.view.record_dispatch(PrefillPlan("first", 1, "first/combine", 10.0, None, (computing,), (), ()), now=0.0)
    return plane


EXPECTED_COPY_KEYS = RequestKeys.of(request("r", ("I", "big", 1000), ("I", "doc", 300), ("R", "q", 5)))


@pytest.mark.parametrize("home", [None, 0], ids=["planned", "pinned"])
def test_a_copy_not_computed_yet_is_read_only_when_its_holders_wait_costs_less_than_recomputing_it(home):
    """Read at once (the paper's optimistic accounting), the expected copy made the reader wait for 2,300 tokens of
    its holder's work to save 300: with ``expected_copies_wait`` the home recomputes it, and reads it once stored."""
    optimistic = expected_copy_plane(False).on_request(EXPECTED_COPY_KEYS, now=1.0, home=home).plan
    assert [(s.action, s.worker) for s in optimistic.segments if s.key == "doc"] == [(Action.REUSE, 1)]
    plane = expected_copy_plane(True)
    waiting = plane.on_request(EXPECTED_COPY_KEYS, now=1.0, home=home).plan
    assert waiting.combine_home != 1  # (idle workers 0 and 2 tie)
    assert [(s.action, s.worker) for s in waiting.segments if s.key == "doc"] == [(Action.COMPUTE,
                                                                                    waiting.combine_home)]
    plane = expected_copy_plane(True)
    plane.on_event(StoreEvent(1, 1, CacheKind.PIC, ("doc",), 300), now=1.0)
    stored = plane.on_request(EXPECTED_COPY_KEYS, now=1.0, home=home).plan
    assert [(s.action, s.worker) for s in stored.segments if s.key == "doc"] == [(Action.REUSE, 1)]


def test_a_stored_copy_is_read_before_an_expected_one():
    plane = expected_copy_plane(True)
    plane.view.release("earlier")  # worker 1's copy is a short wait away, worker 2's is there
    plane.on_event(StoreEvent(2, 1, CacheKind.PIC, ("doc",), 300), now=1.0)
    plan = plane.on_request(EXPECTED_COPY_KEYS, now=1.0).plan
    assert [(s.action, s.worker) for s in plan.segments if s.key == "doc"] == [(Action.REUSE, 2)]


def test_the_lead_a_waiting_home_prefills_is_planned_as_its_own_work():
    """This project's peers prefill the prompt's lead (regular tokens past the prefix hit, before the first PIC
    segment) while a combine waits for remote KV (``lead_while_waiting``). Planned so, the lead overlaps a helper
    that computes the cold document, and worker 0 (which holds the big one) stays home; counted after the wait
    (§7.2), the document stays at the home."""
    for lead_while_waiting, doc_worker in ((False, 0), (True, 1)):
        costs = TransferCosts([[0.0, 0.01], [0.01, 0.0]], latency=[[0.0, 150.0], [150.0, 0.0]],
                              combine_queues=True, lead_while_waiting=lead_while_waiting)
        plane = ControlPlane(ClusterConfig(num_prefill_workers=2), "nebula", costs=costs)
        plane.on_event(StoreEvent(0, 1, CacheKind.PIC, ("big",), 1000), now=0.0)
        plane.view.reserve("earlier", 1, 50.0)
        keys = RequestKeys.of(request("r", ("R", "lead", 400), ("I", "big", 1000), ("I", "doc", 100), ("R", "q", 5)))
        plan = plane.on_request(keys, now=1.0).plan
        assert plan.combine_home == 0
        assert [(s.action, s.worker) for s in plan.segments if s.key == "doc"] == [(Action.COMPUTE, doc_worker)]
        assert plane.policy.lead(keys, 0) == (400.0 if lead_while_waiting else 0.0)
        assert plane.policy.lead(keys, 1) == 0.0  # a prefix hit through the lead leaves nothing to prefill


def lead_plane(prefix_holders: tuple[int, ...], lead_while_waiting: bool = True) -> ControlPlane:
    """Two workers; worker 0 holds a big document (so it is the home), ``prefix_holders`` the system prompt."""
    costs = TransferCosts([[0.0, 0.01], [0.01, 0.0]], latency=[[0.0, 20.0], [20.0, 0.0]], combine_queues=True,
                          lead_while_waiting=lead_while_waiting)
    plane = ControlPlane(ClusterConfig(num_prefill_workers=2), "nebula", costs=costs)
    plane.on_event(StoreEvent(0, 1, CacheKind.PIC, ("big",), 1000), now=0.0)
    for worker in prefix_holders:
        plane.on_event(StoreEvent(worker, 2, CacheKind.PC, (LEAD_KEYS.pc_keys[0],), 100), now=0.0)
    return plane


LEAD_KEYS = RequestKeys.of(request("r", ("P", "sys", 100), ("R", "lead", 400), ("I", "big", 1000),
                                   ("I", "doc", 50), ("R", "q", 5)))


def test_a_lead_is_prefilled_by_an_idle_worker_that_holds_its_prefix():
    """The lead (400 regular tokens past the cached system prompt, before the documents) is exact KV that any worker
    holding the same prefix computes alike: planned like a cold segment, it goes to idle worker 1 (the home reads
    its pages), and the home's reservation is the combine without it."""
    plane = lead_plane(prefix_holders=(0, 1))
    plan = plane.on_request(LEAD_KEYS, now=1.0).plan
    assert plan.combine_home == 0 and plan.prefix == PrefixPlan(0, 1, 100)
    assert plan.lead == LeadPlan(1, 400, "r/lead")
    combine = plane.policy.combine_cost(LEAD_KEYS, 1)
    assert plan.combine_tokens == pytest.approx(combine - 400)
    assert [(s.key, s.action, s.worker) for s in plan.segments] == [("big", Action.REUSE, 0),
                                                                     ("doc", Action.COMPUTE, 0)]
    assert plane.view.outstanding() == [pytest.approx(50 + combine - 400), 400.0]
    plane.on_event(DoneEvent(1, 3, "r/lead"), now=1.5)
    assert plane.view.outstanding()[1] == 0.0


@pytest.mark.parametrize("prefix_holders, lead_while_waiting", [((0,), True), ((0, 1), False)],
                         ids=["helper-lacks-the-prefix", "paper-model"])
def test_a_lead_stays_home_where_no_helper_can_compute_it_alike(prefix_holders, lead_while_waiting):
    """Worker 1 without the system prompt would prefill it too, so the lead stays with the home (and in its
    reservation); in the paper's model the lead is part of the combine."""
    plane = lead_plane(prefix_holders, lead_while_waiting)
    plan = plane.on_request(LEAD_KEYS, now=1.0).plan
    assert plan.lead is None
    assert plan.combine_tokens == pytest.approx(plane.policy.combine_cost(LEAD_KEYS, 1))


def test_a_lead_stays_home_when_the_helper_is_busier():
    plane = lead_plane(prefix_holders=(0, 1))
    plane.view.reserve("earlier", 1, 2000.0)
    plan = plane.on_request(LEAD_KEYS, now=1.0).plan
    assert plan.combine_home == 0 and plan.lead is None


def test_a_segment_not_worth_reading_still_draws_the_request_to_the_worker_that_holds_it():
    """Whether a copy pays depends on the home: a short segment behind a slow link is a hit at its holder and
    cold anywhere else. Planned once for every home, the holder wins while its queue is short, and reuses its copy
    (before, the home was chosen as if every copy could be read, then the copies not worth reading were dropped
    everywhere, the holder's own included, and the segment was prefilled again on worker 0)."""
    latency = [[0.0, 150.0], [150.0, 0.0]]
    for queued, home, action in ((50.0, 1, Action.REUSE), (200.0, 0, Action.COMPUTE)):
        plane = ControlPlane(ClusterConfig(num_prefill_workers=2), "nebula",
                             costs=TransferCosts([[0.0, 0.1], [0.1, 0.0]], latency=latency))
        plane.on_event(StoreEvent(1, 1, CacheKind.PIC, ("doc-a",), 100), now=0.0)
        plane.view.reserve("earlier", 1, queued)
        keys = RequestKeys.of(request("r", ("I", "doc-a", 100), ("I", "doc-b", 250), ("R", "q", 5)))
        plan = plane.on_request(keys, now=1.0).plan
        assert plan.combine_home == home, queued
        assert [(s.action, s.worker) for s in plan.segments if s.key == "doc-a"] == [(action, home)]


def test_pinned_home_reads_the_cheapest_copy_worth_reading():
    keys = RequestKeys.of(request("r", ("I", "doc", 100), ("R", "q", 5)))
    plan = slow_tier_plane(d=0.6, host=0.5).on_request(keys, now=1.0, home=0).plan
    assert [(s.action, s.worker) for s in plan.segments] == [(Action.COMPUTE, 0)]
    plane = slow_tier_plane(d=0.6, host=0.5)
    plane.on_event(StoreEvent(0, 2, CacheKind.PIC, ("doc",), 100, Tier.HOST), now=0.0)
    plan = plane.on_request(keys, now=1.0, home=0).plan
    assert [(s.action, s.worker, s.tier) for s in plan.segments] == [(Action.REUSE, 0, Tier.HOST)]


def test_baselines_default_to_plain_lru_nebula_to_self_tuning():
    assert default_cache("pc") == default_cache("local-pic") == "unified-lru"
    assert default_cache("nebula") == "self-tuning"


def test_the_light_list_of_policy_names_names_exactly_the_policies_in_comparison_order():
    from nebula_engine.cluster.control.policies import POLICIES
    from nebula_engine.cluster.control.policy_names import POLICY_NAMES

    assert tuple(POLICIES) == POLICY_NAMES


@pytest.mark.parametrize("scheduler", [LocalityScheduler, LoadScheduler])
def test_the_strawman_schedulers_leave_a_worker_that_is_down_alone(scheduler):
    costs = TransferCosts([[0.0, 0.1, 0.1], [0.1, 0.0, 0.1], [0.1, 0.1, 0.0]])
    problem = PlanningProblem((), (50, 40, 30), (math.inf, 0.0, 5.0), 10.0)
    for seed in range(10):
        plan = scheduler(costs, seed).place(problem)
        assert plan.home != 0 and 0 not in plan.cold_workers
    with pytest.raises(ValueError, match="every prefill worker is down"):
        scheduler(costs).place(PlanningProblem((), (50,), (math.inf,) * 3, 10.0))


@pytest.mark.parametrize("shared_cores", [False, True])
@pytest.mark.parametrize("policy", ["pc", "local-pic", "nebula"])
def test_no_policy_plans_on_a_worker_that_is_down(policy, shared_cores):
    profile = replace(CONFIG.profile, shared_compute=shared_cores, node_cores=1.0)
    plane = ControlPlane(ClusterConfig(num_prefill_workers=3, profile=profile), policy)
    plane.view.set_down(1, True)
    for keys in [RequestKeys.of(r) for r in rag_requests(30, documents=12)]:
        plan = plane.on_request(keys, 0.0).plan
        assert plan.combine_home != 1 and all(s.worker != 1 for s in plan.segments)
    plane.view.set_down(1, False)
    fresh = [request(f"f{i}", ("P", f"sys{i}", 100), *(("I", f"new{i}-{d}", 200) for d in range(4))) for i in range(30)]
    plans = [plane.on_request(RequestKeys.of(r), 1.0).plan for r in fresh]
    assert any(p.combine_home == 1 or any(s.worker == 1 for s in p.segments) for p in plans)  # up: planned on again

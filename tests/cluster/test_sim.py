from dataclasses import replace

import pytest

from builders import rag_requests, request
from nebula_engine.cluster.control.config import ClusterConfig
from nebula_engine.cluster.control.messages import Action, CacheKind
from nebula_engine.cluster.sim.simulator import SimulationConfig, Simulator, simulate
from nebula_engine.cluster.sim.report import coefficient_of_variation, percentile
from nebula_engine.workloads import load_workload, reuse_stats
from nebula_engine.workloads.registry import WorkloadDataMissing

CLUSTER = ClusterConfig(num_prefill_workers=4)


def config(**changes) -> SimulationConfig:
    return replace(SimulationConfig(cluster=CLUSTER, qps=20.0), **changes)


def small_cache(tokens: int, **changes) -> SimulationConfig:
    return config(cluster=CLUSTER.with_profile(cache_capacity_tokens=tokens, host_capacity_tokens=0), **changes)


def test_same_seed_same_report():
    requests = rag_requests(150)
    assert simulate(config(), requests) == simulate(config(), requests)


def test_seed_changes_arrivals():
    requests = rag_requests(150)
    other = config(cluster=replace(CLUSTER, seed=1))
    assert simulate(config(), requests).ttfts_s != simulate(other, requests).ttfts_s


def test_single_request_ttft_is_prefill_plus_handoff():
    req = request("r", ("P", "sys", 300), ("R", "q", 50))
    report = simulate(config(policy="pc"), [req])
    profile = CLUSTER.profile
    home = 0  # ties on an idle cluster: whichever worker, the handoff link is inter-node from node 0
    expected_prefill = profile.prefill.seconds(350, 0)
    handoff = report.ttft_p50_s - expected_prefill
    assert handoff == pytest.approx(profile.transfer_seconds(home, CLUSTER.decode_worker, 350), rel=1e-6) or \
        handoff == pytest.approx(profile.transfer_seconds(3, CLUSTER.decode_worker, 350), rel=1e-6)


def test_repeat_request_hits_prefix_cache():
    req = request("a", ("P", "sys", 300), ("R", "q", 100))
    again = request("b", ("P", "sys", 300), ("R", "q", 100))
    report = simulate(config(policy="pc", qps=0.5), [req, again])
    assert report.cache_hit_ratio == pytest.approx(400 / 800)


def test_nebula_parallelises_cold_segments():
    docs = [("I", f"doc{i}", 2000) for i in range(4)]
    req = request("r", ("P", "sys", 100), *docs, ("R", "q", 10))
    nebula = simulate(config(policy="nebula"), [req])
    local = simulate(config(policy="local-pic"), [req])
    assert nebula.ttft_p50_s < 0.5 * local.ttft_p50_s
    assert nebula.transferred_bytes > 0 and local.transferred_bytes == 0


def test_pic_policies_hit_more_than_pc():
    requests = rag_requests(300)
    chr_by_policy = {p: simulate(config(policy=p), requests).cache_hit_ratio
                     for p in ("pc", "local-pic", "nebula")}
    assert chr_by_policy["pc"] < chr_by_policy["local-pic"] < chr_by_policy["nebula"]


def view_variant(view: str):
    """Moderate cache pressure, no overload: where the views' failure modes show (§5.1)."""
    return simulate(small_cache(8000, view=view, qps=5.0), rag_requests(400, documents=200))


def test_optimistic_view_reports_more_invalid_hits_than_nebula():
    optimistic, nebula = view_variant("optimistic"), view_variant("nebula")
    assert nebula.invalid_hit_tokens < optimistic.invalid_hit_tokens


def test_event_view_repeats_in_flight_work_nebula_does_not():
    event, nebula = view_variant("event"), view_variant("nebula")
    assert event.repeated_tokens > 0 and nebula.repeated_tokens < event.repeated_tokens


def test_warmup_requests_are_not_measured():
    report = simulate(config(warmup_requests=50), rag_requests(120))
    assert report.num_requests == 70


def test_self_tuning_moves_share_under_pressure():
    report = simulate(small_cache(2000, cache="self-tuning"), rag_requests(400, documents=80))
    assert len(report.pc_share_history) == 1 + 400 // 16
    assert report.pc_share_history[-1] != 0.5


def test_every_cache_variant_runs():
    requests = rag_requests(100)
    for cache in ("unified-lru", "fixed-partition"):
        assert simulate(small_cache(3000, cache=cache), requests).num_requests == 100
    with pytest.raises(ValueError, match="unknown cache"):
        simulate(config(cache="nope"), requests)


def test_every_scheduler_runs():
    requests = rag_requests(100)
    for scheduler in ("greedy", "locality", "load"):
        report = simulate(config(scheduler=scheduler), requests)
        assert report.num_requests == 100 and report.ttft_p50_s > 0


def test_report_arithmetic():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert coefficient_of_variation([1.0, 1.0]) == 0.0
    assert coefficient_of_variation([0.0, 2.0]) == 1.0


TRACE_SLICES = {"ragpulse": 200, "tau-bench": 20, "chatdev": 12, "swe-agent": 13, "doc2dial": 40, "quac": 60}


@pytest.fixture(scope="module")
def trace_slices():
    slices = {}
    for name, limit in TRACE_SLICES.items():
        try:
            slices[name] = load_workload(name, limit=limit)
        except WorkloadDataMissing:
            continue  # a trace directory this checkout lacks (CI has ../shared/traces)
    return slices


@pytest.mark.parametrize("policy", ["pc", "local-pic", "nebula"])
@pytest.mark.parametrize("capacity", [None, 3000])
def test_hit_ratio_never_exceeds_the_analysis_bound(trace_slices, policy, capacity):
    """Defect 1: every hit counted by the simulator is one the reuse analysis (`analyze`) allows."""
    assert "ragpulse" in trace_slices  # the bundled slice at least
    cluster = CLUSTER if capacity is None else CLUSTER.with_profile(cache_capacity_tokens=capacity,
                                                                     host_capacity_tokens=2 * capacity)
    for name, requests in trace_slices.items():
        bound = reuse_stats(requests).pic_hit_tokens / reuse_stats(requests).total_tokens
        report = simulate(config(cluster=cluster, policy=policy, qps=50.0), requests)
        assert report.cache_hit_ratio <= bound + 1e-12, name


def test_host_tier_serves_hits_the_device_evicted():
    """Defect 3 / point 4: evicted entries are demoted to the host tier and read back from there."""
    requests = rag_requests(400, documents=60)
    device_only = simulate(small_cache(1500, qps=5.0), requests)
    tiered = simulate(config(cluster=CLUSTER.with_profile(cache_capacity_tokens=1500, host_capacity_tokens=20_000),
                             qps=5.0), requests)
    assert device_only.host_hit_tokens == 0 < tiered.host_hit_tokens
    assert tiered.cache_hit_ratio > device_only.cache_hit_ratio


def test_fetched_segments_are_stored_at_the_home_and_reported():
    """Point 4: a segment read from another worker lands in the home's store, and the view learns it."""
    simulator = Simulator(config(qps=5.0), rag_requests(150))
    plans, plan = [], simulator.control.on_request
    simulator.control.on_request = lambda *args, **kwargs: plans.append(plan(*args, **kwargs)) or plans[-1]
    simulator.run()
    fetched = {(s.key, d.plan.combine_home) for d in plans for s in d.plan.segments
               if s.action is Action.REUSE and s.worker != d.plan.combine_home}
    assert len(fetched) > 10
    for key, home in fetched:
        assert simulator.caches[home].has(CacheKind.PIC, key)
        assert simulator.control.view.holders(CacheKind.PIC, key, now=1e9)[home].confirmed


def test_running_requests_hold_device_space_until_their_hand_off():
    simulator = Simulator(small_cache(100_000, qps=1000.0), rag_requests(20))
    simulator.run()
    assert all(cache.device.pinned == 0 for cache in simulator.caches)  # every pin released at the end

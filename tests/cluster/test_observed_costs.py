"""The planner's fixed transfer costs follow what reads and scatters take (ObservedTransferCosts), alone and in the
router: homes report each read in their combine's TaskDone."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from nebula_engine.cluster.control.config import ClusterConfig
from nebula_engine.cluster.control.observed_costs import ObservedTransferCosts
from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.liveness import Liveness
from nebula_engine.cluster.runtime.router import RouterService
from test_router import Clock, submit


def profile(read_s: float = 0.05, dispatch_s: float = 0.1):
    base = ClusterConfig(num_prefill_workers=2).profile
    return replace(base, intra_node=replace(base.intra_node, latency_s=read_s),
                   inter_node=replace(base.inter_node, latency_s=read_s), dispatch_s=dispatch_s)


def test_the_configured_costs_hold_until_observations_outweigh_them():
    observed = ObservedTransferCosts(profile(read_s=0.05), window=4)
    assert observed.read_latency_s == 0.05 and observed.dispatch_s == 0.1
    assert observed.current_profile() == profile()
    observed.observe_read(0.2)
    assert observed.read_latency_s == pytest.approx(0.125)  # the configured value counts as one observation
    for seconds in (0.3, 0.4, 0.5):
        observed.observe_read(seconds)
    assert observed.read_latency_s == pytest.approx(0.35)  # the window moved past the configured value
    current = observed.current_profile()
    assert current.intra_node.latency_s == current.inter_node.latency_s == pytest.approx(0.35)
    assert current.intra_node.bandwidth_bytes_per_s == profile().intra_node.bandwidth_bytes_per_s
    assert current.dispatch_s == 0.1 and current.prefill == profile().prefill


def test_a_scatters_dispatch_is_what_its_prefill_and_the_read_do_not_explain():
    base = profile(read_s=0.05, dispatch_s=0.1)
    observed = ObservedTransferCosts(base, window=1)
    prefill_s = base.prefill.compute_seconds(200, 0.0)
    observed.observe_scatter(prefill_s + 0.05 + 0.7, 200)
    assert observed.dispatch_s == pytest.approx(0.7)
    observed.observe_scatter(0.0, 200)  # faster than predicted: no negative dispatch
    assert observed.dispatch_s == 0.0
    with pytest.raises(ValueError, match="window"):
        ObservedTransferCosts(base, window=0)


def router(observe: bool):
    sent, clock = [], Clock()
    service = RouterService("prefill-0", ["prefill-0", "prefill-1"], ["decode-0"], ClusterConfig(num_prefill_workers=2),
                            "nebula", lambda peer, msg: sent.append((peer, msg)),
                            lambda spec, ids: "pic-" + "-".join(map(str, ids)),
                            Liveness("prefill-0", ["prefill-0", "prefill-1", "decode-0"], clock=clock),
                            observe_transfers=observe)
    service.activate()
    sent.clear()
    return service, sent


def scatters(sent) -> int:
    return sum(isinstance(message, wire.Scatter) for _, message in sent)


@pytest.mark.parametrize("observe", [True, False])
def test_slow_scatters_reported_by_homes_stop_the_router_scattering(observe):
    """Idle workers on the paper's profile (no dispatch cost configured): four cold 400-token documents are spread.
    When homes report that scatters took 30 s each, an observing router keeps the next request's documents at home."""
    service, sent = router(observe)
    service.on_submit(submit("r1", [[50 + i] * 400 for i in range(4)]))
    assert scatters(sent) > 0
    [(home, combine)] = [(peer, m) for peer, m in sent if isinstance(m, wire.Combine)]
    slow = [wire.TransferTime(s.peer, 30.0, 400, scattered=True) for s in combine.sources if s.fresh]
    for index in range(40):
        service.on_task_done(wire.TaskDone(sender=home, worker_index=service.prefill_peers.index(home),
                                           task_id=combine.task_id if index == 0 else f"other/{index}", seq=index + 1,
                                           request_id="r1", transfers=slow))
    sent.clear()
    service.on_submit(submit("r2", [[60 + i] * 400 for i in range(4)]))
    assert (scatters(sent) == 0) is observe
    if observe:
        assert service.observed.dispatch_s > 29.0 and service.control.costs.dispatch[0][1] > 0


def test_a_faster_prefill_timing_reaches_the_observed_costs():
    """An observing router converts the observed read latency with the new prefill speed too."""
    service, _ = router(observe=True)
    service.on_task_done(wire.TaskDone(sender="prefill-1", worker_index=1, task_id="t", seq=1, request_id="r",
                                       transfers=[wire.TransferTime("prefill-0", 0.4, 100, scattered=False)]))
    latency_tokens = service.control.costs.latency[1][0]
    assert service.faster_prefill_timed(service.config.profile.prefill.per_token_s / 4)
    assert service.observed.profile.prefill == service.config.profile.prefill
    assert service.control.costs.latency[1][0] == pytest.approx(4 * latency_tokens)
    configured = service.config.profile.intra_node.latency_s
    assert service.observed.read_latency_s == pytest.approx(statistics.median([configured, 0.4]))  # still observed

"""The router without processes: plans become messages, events update the view, silence triggers re-plans."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.control.config import ClusterConfig
from nebula_engine.cluster.control.messages import CacheKind, DoneEvent, EvictEvent, MoveEvent, StoreEvent, Tier
from nebula_engine.cluster.control.request_keys import block_segments, prompt_keys
from nebula_engine.cluster.runtime.liveness import Liveness
from nebula_engine.cluster.runtime.router import RouterService


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def liveness_of(name: str, clock, peers=("prefill-0", "prefill-1", "decode-0")) -> Liveness:
    """The peer's one liveness tracker, which the router reads (3 s, the peers' default timeout)."""
    return Liveness(name, peers, dead_after_s=3.0, clock=clock)


@pytest.fixture
def router():
    sent: list[tuple[str, wire.Msg]] = []
    clock = Clock()
    service = RouterService("prefill-0", ["prefill-0", "prefill-1"], ["decode-0"], ClusterConfig(num_prefill_workers=2),
                            "nebula", lambda peer, msg: sent.append((peer, msg)),
                            lambda spec, ids: "pic-" + "-".join(map(str, ids)), liveness_of("prefill-0", clock))
    service.activate()
    sent.clear()
    return service, sent, clock


def submit(request_id: str, docs: list[list[int]], attempt: int = 0, route: str = "") -> wire.Submit:
    tokens, segments = [1, 2, 3], [wire.Segment("regular", 0, 3)]
    for doc in docs:
        segments.append(wire.Segment("pic", len(tokens), len(doc)))
        tokens += doc
    segments.append(wire.Segment("regular", len(tokens), 2))
    tokens += [9, 9]
    return wire.Submit(sender="decode-0", request_id=request_id, attempt=attempt, token_ids=tokens, segments=segments,
                       params=wire.Params(fields={"max_tokens": 4}), pic_backend="", route=route)


def test_codec_round_trips_every_message_kind():
    message = submit("r", [[5, 6, 7]])
    assert wire.decode(wire.encode(message)) == message
    event = wire.CacheEventMsg(sender="p", worker_index=1, events=[
        StoreEvent(1, 4, CacheKind.PIC, ("k",), 3, Tier.HOST),
        StoreEvent(1, 5, CacheKind.PC, ("a", "b"), 32, parent_key="root"),
        EvictEvent(1, 6, CacheKind.PC, ("a",), 16, Tier.DISK),
        MoveEvent(1, 7, CacheKind.PIC, ("k",), 3, Tier.HOST, Tier.DEVICE)])
    decoded = wire.decode(wire.encode(event))
    assert decoded == event
    assert decoded.events[0].kind is CacheKind.PIC and decoded.events[0].tier is Tier.HOST  # the enums, not strings


def test_the_codec_refuses_a_cache_event_of_an_unknown_kind_or_shape():
    import msgspec
    good = wire.encode(wire.CacheEventMsg(sender="p", worker_index=1,
                                          events=[StoreEvent(1, 4, CacheKind.PIC, ("k",), 3)]))
    for bad in (good.replace(b"StoreEvent", b"StoreEvenX"), good.replace(b"\xa3pic", b"\xa3pix")):
        with pytest.raises(msgspec.ValidationError):
            wire.decode(bad)


def test_a_request_becomes_one_combine_and_scatters_for_remote_cold_segments(router):
    service, sent, _ = router
    service.on_submit(submit("r1", [[10] * 200, [11] * 200, [12] * 200, [13] * 200]))
    combines = [(peer, m) for peer, m in sent if isinstance(m, wire.Combine)]
    scatters = [(peer, m) for peer, m in sent if isinstance(m, wire.Scatter)]
    assert len(combines) == 1
    home, combine = combines[0]
    assert combine.decode_peer == "decode-0" and combine.frontend == "decode-0"
    # cold segments placed on the other worker are prefilled there and fetched from there
    assert scatters and all(peer != home for peer, _ in scatters)
    assert {s.segment_index for s in combine.sources} == {m.segment_index for _, m in scatters}
    assert len(combine.local_task_ids) + len(scatters) == 4
    # the cold segments planned on the home itself are named, so it prefills them while it fetches the others
    assert sorted(combine.compute_here + [m.segment_index for _, m in scatters]) == [0, 1, 2, 3]
    assert "r1" in service.in_flight
    # a segment prefilled for this request and read back is no cache hit: the home is told so
    assert all(source.fresh for source in combine.sources)


def test_store_events_make_a_remote_copy_reusable(router):
    service, sent, _ = router
    key = "pic-" + "-".join(["20"] * 50)
    service.on_cache_events(wire.CacheEventMsg(sender="prefill-1", worker_index=1,
                                               events=[StoreEvent(1, 1, CacheKind.PIC, (key,), 50)]))
    service.on_submit(submit("r2", [[20] * 50], route="prefill-0"))
    combine = next(m for _, m in sent if isinstance(m, wire.Combine))
    assert [(s.key, s.peer) for s in combine.sources] == [(key, "prefill-1")]
    assert not any(isinstance(m, wire.Scatter) for _, m in sent)
    assert not combine.sources[0].fresh  # it existed before the request: a hit
    assert combine.prefix_peer == "" and combine.prefix_tokens == 0


def test_a_combine_away_from_the_prefix_holder_is_told_to_read_the_prefix_from_it(router):
    service, sent, _ = router
    first = submit("r3", [[30] * 64], route="prefill-1")
    service.on_submit(first)  # recorded on dispatch: prefill-1 holds the system prompt and the document
    sent.clear()
    service.on_submit(submit("r4", [[30] * 64], route="prefill-0"))
    combine = next(m for peer, m in sent if isinstance(m, wire.Combine) and peer == "prefill-0")
    assert combine.prefix_peer == "prefill-1" and combine.prefix_tokens == 3 + 64 + 2  # the same prompt: all of it


def test_a_silent_home_has_its_requests_reported_lost_and_the_front_end_plans_them_again_elsewhere(router):
    service, sent, clock = router
    service.on_submit(submit("r3", [[30] * 10], route="prefill-1"))
    first = next(m for peer, m in sent if isinstance(m, wire.Combine))
    assert service.in_flight["r3"].home == 1
    sent.clear()
    clock.now += 1.0
    for peer in ("prefill-0", "decode-0"):
        service.liveness.heard(peer)
    clock.now += service.dead_after_s
    assert service.check_liveness() == ["prefill-1"]
    [(frontend, lost)] = sent
    assert frontend == "decode-0" and isinstance(lost, wire.Failed) and lost.resumable
    assert lost.attempt == first.attempt and "prefill-1" in lost.message and "r3" not in service.in_flight
    sent.clear()
    service.on_submit(submit("r3", [[30] * 10], attempt=first.attempt + 1, route="prefill-1"))  # the front end's retry
    combine_peer, combine = next((p, m) for p, m in sent if isinstance(m, wire.Combine))
    assert combine_peer == "prefill-0" and combine.attempt == first.attempt + 1 and combine.sources == []
    service.on_task_done(wire.TaskDone(sender="prefill-0", worker_index=0, task_id=combine.task_id, seq=1,
                                       request_id="r3"))
    assert "r3" not in service.in_flight


def test_a_router_that_does_not_lead_refuses_submissions(router):
    service, sent, _ = router
    service.deactivate()
    service.on_submit(submit("r4", [[40] * 10]))
    assert sent == [("decode-0", wire.NotLeader(sender="prefill-0", request_id="r4", attempt=0))]


def test_a_snapshot_replaces_what_the_router_knew_of_a_worker(router):
    service, _, _ = router
    stale = StoreEvent(1, 40, CacheKind.PIC, ("old",), 5)
    service.on_cache_events(wire.CacheEventMsg(sender="prefill-1", worker_index=1, events=[stale]))
    fresh = StoreEvent(1, 1, CacheKind.PIC, ("new",), 5)
    # a restarted worker numbers from 1 again: its snapshot still counts
    service.on_cache_events(wire.CacheEventMsg(sender="prefill-1", worker_index=1, events=[fresh], snapshot=True))
    assert service.control.view.holders(CacheKind.PIC, "old", 100.0) == {}
    assert 1 in service.control.view.holders(CacheKind.PIC, "new", 100.0)


def test_events_keep_the_workers_sequence_numbers_and_tiers(router):
    service, _, _ = router
    view = service.control.view

    def events(*items) -> wire.CacheEventMsg:
        return wire.CacheEventMsg(sender="prefill-1", worker_index=1, events=list(items))

    doc = (CacheKind.PIC, ("doc",), 8)
    service.on_cache_events(events(StoreEvent(1, 5, *doc), EvictEvent(1, 6, *doc), StoreEvent(1, 7, *doc, Tier.DISK)))
    assert view.holders(CacheKind.PIC, "doc", 100.0)[1].tier is Tier.DISK  # not collapsed into host
    # a duplicate of the worker's event 6 (an eviction) is recognised by its number and ignored
    service.on_cache_events(events(EvictEvent(1, 6, *doc, Tier.DISK)))
    assert 1 in view.holders(CacheKind.PIC, "doc", 100.0)
    service.on_cache_events(events(EvictEvent(1, 8, *doc, Tier.DISK)))
    assert view.holders(CacheKind.PIC, "doc", 100.0) == {}
    service.on_task_done(wire.TaskDone(sender="prefill-1", worker_index=1, task_id="t", seq=9))
    assert not view.apply(DoneEvent(1, 9, "t"), 100.0)  # the view saw the worker's own number 9


@pytest.mark.parametrize("policy", ["pc", "local-pic", "nebula"])
def test_a_new_leader_never_plans_on_a_peer_it_has_declared_dead(policy):
    """Regression: with the shared-cores work floor, a dead peer's load once entered the floor, every home tied
    at it, and a retried request could be planned on the dead peer again and wait forever."""
    sent: list[tuple[str, wire.Msg]] = []
    clock = Clock()
    peers = ["prefill-0", "prefill-1", "prefill-2"]
    config = ClusterConfig(num_prefill_workers=3)
    config = replace(config, profile=replace(config.profile, shared_compute=True, node_cores=2.0))
    service = RouterService("decode-1", peers, ["decode-0", "decode-1"], config, policy,
                            lambda peer, msg: sent.append((peer, msg)),
                            lambda spec, ids: "pic-" + "-".join(map(str, ids)),
                            Liveness("decode-1", peers + ["decode-0", "decode-1"], dead_after_s=3.0, clock=clock))
    service.activate()  # a fresh leader: it thinks every peer alive until they stay silent
    clock.now += service.dead_after_s + 0.5
    for peer in ("prefill-0", "prefill-2", "decode-0"):
        service.liveness.heard(peer)
    assert service.check_liveness() == ["prefill-1"]
    sent.clear()
    for i in range(24):
        service.on_submit(submit(f"r{i}", [[50 + i] * 40, [80 + i % 3] * 30], route="prefill-1" if i % 2 else ""))
    assert {peer for peer, m in sent if isinstance(m, (wire.Combine, wire.Scatter))} <= {"prefill-0", "prefill-2"}
    assert not any(isinstance(m, wire.Failed) for _, m in sent)
    service.liveness.heard("prefill-1")  # it came back: its next message revives it
    service.seen("prefill-1")
    sent.clear()
    for i in range(12):
        service.on_submit(submit(f"back{i}", [[120 + i] * 40], route="prefill-1"))
    assert {peer for peer, m in sent if isinstance(m, wire.Combine)} == {"prefill-1"}


def test_with_every_prefill_peer_dead_a_request_fails_at_once(router):
    service, sent, clock = router
    clock.now += service.dead_after_s + 0.5
    service.liveness.heard("decode-0")
    assert sorted(service.check_liveness()) == ["prefill-1"]  # the router's own peer is never declared dead
    service.control.view.set_down(0, True)  # as if prefill-0 were silent too
    sent.clear()
    service.on_submit(submit("r9", [[60] * 10]))
    [(frontend, failed)] = sent
    assert frontend == "decode-0" and isinstance(failed, wire.Failed) and "every prefill worker is down" in failed.message
    assert "r9" not in service.in_flight


def test_a_faster_prefill_timing_converts_transfer_seconds_into_more_prefill_tokens_and_a_slower_one_is_ignored(router):
    service, _, _ = router
    per_token_s = service.config.profile.prefill.per_token_s
    latency_tokens = service.control.costs.latency[0][1]
    assert latency_tokens > 0
    assert service.faster_prefill_timed(per_token_s / 2)
    assert service.control.costs.latency[0][1] == pytest.approx(2 * latency_tokens)
    assert service.control.costs.to[0][1] == pytest.approx(2 * ClusterConfig(num_prefill_workers=2)
                                                           .profile.relative_transfer_cost(1, 0))
    for slower in (per_token_s, per_token_s / 2, 0.0, -1.0):  # slower, equal, or no timing: shared cores at work
        assert not service.faster_prefill_timed(slower)
    assert service.config.profile.prefill.per_token_s == per_token_s / 2
    service.deactivate()
    service.activate()  # a router that leads again plans with the fastest timing it has seen
    assert service.control.costs.latency[0][1] == pytest.approx(2 * latency_tokens)


def test_a_lead_planned_on_another_peer_is_prefilled_there_and_read_as_the_homes_prefix():
    """With a local cluster's engines (``lead_while_waiting``), the regular tokens before the first PIC segment may
    go to a peer that holds the same prefix (here: none, as nothing is cached): it gets them in a ``ScatterLead``,
    and the home reads them from it as its prefix, told that they were prefilled for the request (no cache hit)."""
    sent: list[tuple[str, wire.Msg]] = []
    config = ClusterConfig(num_prefill_workers=2)
    config = config.with_profile(lead_while_waiting=True, combine_queues=True)
    service = RouterService("prefill-0", ["prefill-0", "prefill-1"], ["decode-0"], config, "nebula",
                            lambda peer, msg: sent.append((peer, msg)), lambda spec, ids: f"pic-{ids[0]}",
                            liveness_of("prefill-0", Clock()))
    service.activate()
    system, doc, question = list(range(100, 700)), [7] * 300, [9, 9]
    tokens = system + doc + question
    segments = [wire.Segment("regular", 0, 600), wire.Segment("pic", 600, 300), wire.Segment("regular", 900, 2)]
    service.on_submit(wire.Submit(sender="decode-0", request_id="r", attempt=0, token_ids=tokens, segments=segments,
                                  params=wire.Params(fields={"max_tokens": 4}), pic_backend=""))
    (helper, lead), = [(peer, m) for peer, m in sent if isinstance(m, wire.ScatterLead)]
    home, combine = next((peer, m) for peer, m in sent if isinstance(m, wire.Combine))
    assert helper != home and lead.token_ids == system and lead.task_id == "r#0/lead"
    assert combine.prefix_peer == helper and combine.prefix_tokens == 600 and combine.prefix_fresh
    assert combine.compute_here == [0]  # the document is the home's, prefilled while the lead is
    assert lead.task_id in service.in_flight["r"].tasks
    # the router keys the system prompt in blocks of 256 tokens: a later prompt sharing its start shares those keys
    view = service.control.view
    assert view.prefix_matches(prompt_keys("x", block_segments([("regular", system[:512] + [1] * 88)]),
                                           str).pc_keys, 100.0) == {service.prefill_peers.index(home): 2}

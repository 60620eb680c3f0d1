from nebula_engine.cluster.control.config import ViewConfig
from nebula_engine.cluster.control.messages import (Action, CacheKind, DoneEvent, EvictEvent, MoveEvent,
                                                    PrefillPlan, SegmentPlan, StoreEvent, Tier)
from nebula_engine.cluster.control.view import ClusterView

PIC = CacheKind.PIC


def plan_computing(key: str, worker: int, home: int = 0, request_id: str = "r") -> PrefillPlan:
    segment = SegmentPlan(0, key, 100, worker, Action.COMPUTE, task_id=f"{request_id}/s0")
    return PrefillPlan(request_id, home, f"{request_id}/combine", 10.0, None, (segment,),
                       pc_keys=("chain-a",), segment_tokens=(100,))


def test_unconfirmed_record_expires_after_ttl():
    view = ClusterView(2, ViewConfig(unconfirmed_ttl_s=5.0))
    view.record_dispatch(plan_computing("doc", worker=1), now=0.0)
    assert set(view.holders(PIC, "doc", now=4.999)) == {1}
    assert view.holders(PIC, "doc", now=5.0) == {}


def test_expire_sweep_drops_only_unconfirmed():
    view = ClusterView(2, ViewConfig(unconfirmed_ttl_s=1.0))
    view.record_dispatch(plan_computing("a", worker=1, request_id="r1"), now=0.0)
    view.record_dispatch(plan_computing("b", worker=1, request_id="r2"), now=0.0)
    view.apply(StoreEvent(1, 0, PIC, ("a",), 100), now=0.5)
    assert view.expire(now=2.0) == 2  # "b" and the (shared) unconfirmed prefix-chain record
    assert set(view.holders(PIC, "a", now=2.0)) == {1}
    assert view.holders(PIC, "b", now=2.0) == {}


def test_confirmed_record_never_expires():
    view = ClusterView(2, ViewConfig(unconfirmed_ttl_s=5.0))
    view.record_dispatch(plan_computing("doc", worker=1), now=0.0)
    view.apply(StoreEvent(1, 0, PIC, ("doc",), 100), now=1.0)
    view.expire(now=1e9)
    assert view.holders(PIC, "doc", now=1e9)[1].confirmed


def test_late_store_event_re_registers_expired_location():
    view = ClusterView(2, ViewConfig(unconfirmed_ttl_s=5.0))
    view.record_dispatch(plan_computing("doc", worker=1), now=0.0)
    view.expire(now=6.0)
    assert view.holders(PIC, "doc", now=6.0) == {}
    view.apply(StoreEvent(1, 0, PIC, ("doc",), 100), now=7.0)
    record = view.holders(PIC, "doc", now=100.0)[1]
    assert record.confirmed and record.tier is Tier.DEVICE


def test_evict_event_removes_location():
    view = ClusterView(2)
    view.apply(StoreEvent(0, 0, PIC, ("doc",), 100), now=0.0)
    view.apply(EvictEvent(0, 1, PIC, ("doc",), 100), now=0.1)
    assert view.holders(PIC, "doc", now=0.1) == {}


def test_evict_of_other_tier_keeps_location():
    view = ClusterView(2)
    view.apply(StoreEvent(0, 0, PIC, ("doc",), 100, Tier.HOST), now=0.0)
    view.apply(EvictEvent(0, 1, PIC, ("doc",), 100, Tier.DEVICE), now=0.1)
    assert view.holders(PIC, "doc", now=0.1)[0].tier is Tier.HOST


def test_reservation_released_exactly_once():
    view = ClusterView(2)
    view.record_dispatch(plan_computing("doc", worker=1, home=0), now=0.0)
    assert view.outstanding() == [10.0, 100.0]
    assert view.apply(DoneEvent(1, 0, "r/s0"), now=1.0)
    assert view.outstanding() == [10.0, 0.0]
    assert not view.apply(DoneEvent(1, 0, "r/s0"), now=1.0)  # same sequence number: duplicate
    assert view.apply(DoneEvent(1, 1, "r/s0"), now=1.0)  # new event, same task: no second release
    assert view.outstanding() == [10.0, 0.0]
    assert not view.release("r/s0")


def test_reservations_do_not_expire():
    view = ClusterView(2, ViewConfig(unconfirmed_ttl_s=1.0))
    view.record_dispatch(plan_computing("doc", worker=1), now=0.0)
    view.expire(now=1e6)
    assert view.outstanding_tokens(1) == 100.0


def test_event_view_waits_for_confirmation():
    view = ClusterView(2, ViewConfig(record_on_dispatch=False))
    view.record_dispatch(plan_computing("doc", worker=1), now=0.0)
    assert view.holders(PIC, "doc", now=0.0) == {}
    assert view.outstanding_tokens(1) == 100.0
    view.apply(StoreEvent(1, 0, PIC, ("doc",), 100), now=0.1)
    assert set(view.holders(PIC, "doc", now=0.1)) == {1}


def test_optimistic_view_ignores_events_and_models_lru():
    view = ClusterView(1, ViewConfig(apply_cache_events=False, unconfirmed_ttl_s=None,
                                     modelled_capacity_tokens=250))
    for i, key in enumerate(["a", "b", "c"]):
        segment = SegmentPlan(0, key, 100, 0, Action.COMPUTE, task_id=f"r{i}/s0")
        view.record_dispatch(PrefillPlan(f"r{i}", 0, f"r{i}/c", 0.0, None, (segment,), (), ()), now=i)
    assert view.holders(PIC, "a", now=10.0) == {}  # pushed out by the modelled LRU
    assert set(view.holders(PIC, "c", now=10.0)) == {0}
    view.apply(EvictEvent(0, 0, PIC, ("c",), 100), now=11.0)
    assert set(view.holders(PIC, "c", now=11.0)) == {0}


def test_prefix_matches_per_worker():
    view = ClusterView(3)
    for seq, key in enumerate(["k1", "k2", "k3"]):
        view.apply(StoreEvent(0, seq, CacheKind.PC, (key,), 10), now=0.0)
    view.apply(StoreEvent(1, 0, CacheKind.PC, ("k1",), 10), now=0.0)
    view.apply(StoreEvent(2, 0, CacheKind.PC, ("k2",), 10), now=0.0)  # without k1: unusable
    assert view.prefix_matches(["k1", "k2", "k3", "k4"], now=0.0) == {0: 3, 1: 1}


def test_presence_listener_hears_first_and_last_holder():
    heard = []
    view = ClusterView(2, listener=lambda kind, key, tier, present, n: heard.append((key, tier, present)))
    view.apply(StoreEvent(0, 0, PIC, ("doc",), 100), now=0.0)
    view.apply(StoreEvent(1, 0, PIC, ("doc",), 100), now=0.0)
    view.apply(EvictEvent(0, 1, PIC, ("doc",), 100), now=0.0)
    view.apply(EvictEvent(1, 1, PIC, ("doc",), 100), now=0.0)
    assert heard == [("doc", Tier.DEVICE, True), ("doc", Tier.DEVICE, False)]


def test_presence_is_per_tier():
    heard = []
    view = ClusterView(2, listener=lambda kind, key, tier, present, n: heard.append((tier, present)))
    view.apply(StoreEvent(0, 0, PIC, ("doc",), 100), now=0.0)
    view.apply(EvictEvent(0, 1, PIC, ("doc",), 100), now=0.0)  # demoted: evict from the device, store on the host
    view.apply(StoreEvent(0, 2, PIC, ("doc",), 100, Tier.HOST), now=0.0)
    view.apply(StoreEvent(0, 3, PIC, ("doc",), 100, Tier.DISK), now=0.0)  # a move reported as one store
    assert heard == [(Tier.DEVICE, True), (Tier.DEVICE, False), (Tier.HOST, True), (Tier.HOST, False),
                     (Tier.DISK, True)]
    assert view.holders(PIC, "doc", now=0.0)[0].tier is Tier.DISK


def test_a_tier_move_is_heard_as_an_evict_there_and_a_store_here():
    heard = []
    view = ClusterView(1, listener=lambda kind, key, tier, present, n: heard.append((tier, present, n)))
    view.apply(StoreEvent(0, 0, PIC, ("doc",), 100), now=0.0)
    view.apply(MoveEvent(0, 1, PIC, ("doc",), 100, Tier.DEVICE, Tier.HOST), now=0.0)
    assert heard == [(Tier.DEVICE, True, 100), (Tier.DEVICE, False, 100), (Tier.HOST, True, 100)]
    record = view.holders(PIC, "doc", now=0.0)[0]
    assert record.tier is Tier.HOST and record.confirmed
    view.apply(MoveEvent(0, 2, PIC, ("doc",), 100, Tier.DISK, Tier.DEVICE), now=0.0)  # not from where it was:
    assert view.holders(PIC, "doc", now=0.0)[0].tier is Tier.DEVICE  # the store still moves it, as a late store would


def test_an_event_of_several_keys_splits_its_tokens_evenly():
    view = ClusterView(1)
    view.apply(StoreEvent(0, 0, CacheKind.PC, ("p1", "p2"), 32, Tier.HOST, parent_key="p0"), now=0.0)
    assert [view.holders(CacheKind.PC, key, now=0.0)[0].num_tokens for key in ("p1", "p2")] == [16, 16]
    view.apply(EvictEvent(0, 1, CacheKind.PC, ("p1", "p2"), 32, Tier.HOST), now=0.0)
    assert view.holders(CacheKind.PC, "p1", now=0.0) == view.holders(CacheKind.PC, "p2", now=0.0) == {}


def test_duplicate_and_stale_events_are_ignored_until_the_worker_restarts():
    view = ClusterView(2)
    assert view.apply(StoreEvent(0, 7, PIC, ("doc",), 100), now=0.0)
    assert not view.apply(EvictEvent(0, 7, PIC, ("doc",), 100), now=0.0)  # a duplicate of seq 7
    assert not view.apply(EvictEvent(0, 3, PIC, ("doc",), 100), now=0.0)  # older than what was applied
    assert 0 in view.holders(PIC, "doc", now=0.0)
    view.forget_worker(0)  # the worker restarted: its numbering starts again
    assert view.apply(StoreEvent(0, 1, PIC, ("new",), 10), now=0.0)


def test_prefix_match_counts_device_copies_only():
    view = ClusterView(2)
    view.apply(StoreEvent(0, 0, CacheKind.PC, ("k1",), 10), now=0.0)
    view.apply(StoreEvent(1, 0, CacheKind.PC, ("k1",), 10, Tier.HOST), now=0.0)
    assert view.prefix_matches(["k1"], now=0.0) == {0: 1}


def test_snapshot_install_rebuilds_view():
    view = ClusterView(2, ViewConfig(unconfirmed_ttl_s=5.0))
    view.record_dispatch(plan_computing("doc", worker=1), now=0.0)
    view.apply(StoreEvent(0, 3, PIC, ("other",), 50), now=0.0)
    rebuilt = ClusterView(2, ViewConfig(unconfirmed_ttl_s=5.0))
    rebuilt.install(view.snapshot())
    assert rebuilt.outstanding() == view.outstanding()
    assert set(rebuilt.holders(PIC, "other", now=1.0)) == {0}
    assert not rebuilt.apply(StoreEvent(0, 3, PIC, ("late",), 1), now=1.0)  # seq already seen
    rebuilt.expire(now=5.0)
    assert rebuilt.holders(PIC, "doc", now=5.0) == {}  # TTL carried over
    assert rebuilt.release("r/s0") and not rebuilt.release("r/s0")


def test_an_expected_copy_waits_for_the_work_queued_before_it_and_none_once_stored():
    view = ClusterView(2)
    view.reserve("earlier", 1, 300.0)
    view.record_dispatch(plan_computing("doc", worker=1), now=0.0)
    record = view.holders(PIC, "doc", now=0.0)[1]
    assert view.wait_tokens(record, 1) == 400.0  # the earlier work, then the segment itself
    view.reserve("later", 1, 500.0)  # queued after it: no longer wait
    assert view.wait_tokens(record, 1) == 400.0
    view.release("earlier")
    assert view.wait_tokens(record, 1) == 100.0
    view.apply(StoreEvent(1, 0, PIC, ("doc",), 100), now=0.5)
    assert view.wait_tokens(view.holders(PIC, "doc", now=0.5)[1], 1) == 0.0


def test_an_expected_copy_from_a_snapshot_waits_for_its_holders_whole_queue():
    view = ClusterView(2)
    view.reserve("earlier", 1, 300.0)
    view.record_dispatch(plan_computing("doc", worker=1), now=0.0)
    view.reserve("later", 1, 500.0)
    rebuilt = ClusterView(2)
    rebuilt.install(view.snapshot())
    assert rebuilt.wait_tokens(rebuilt.holders(PIC, "doc", now=0.0)[1], 1) == 900.0

"""What a worker tells the router of its engine's cache events, without an engine: the engine's own event types,
renumbered in the worker's one sequence; PIC events as they are, PC pages only as the loss of a prompt segment."""

from __future__ import annotations

import asyncio

from builders import Clock

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.liveness import Liveness
from nebula_engine.cluster.runtime.cache_reporting import CacheCounts, CacheReporter
from nebula_engine.cluster.runtime.worker import WorkerService
from nebula_engine.kvcache.events import CacheKind, EvictEvent, MoveEvent, StoreEvent, Tier

PIC, PC = CacheKind.PIC, CacheKind.PC


def leading_worker() -> tuple[CacheReporter, list[wire.Msg]]:
    """Worker 2, which leads itself: what it reports reaches ``heard``."""
    heard: list[wire.Msg] = []
    worker = WorkerService("me", "prefill", 2, kv=None, requests=None, agent=None,
                           send=lambda peer, msg: heard.append(msg), leader=lambda: "me", pic_key=lambda spec, ids: "key",
                           liveness=Liveness("me", ["me"], dead_after_s=3.0, clock=Clock()))
    return worker.reporter, heard


def test_pic_events_reach_the_router_unchanged_but_numbered_in_the_workers_sequence():
    worker, heard = leading_worker()
    engine_events = [StoreEvent(2, 1, PIC, ("doc",), 8), MoveEvent(2, 2, PIC, ("doc",), 8, Tier.DEVICE, Tier.DISK),
                     EvictEvent(2, 3, PIC, ("doc",), 8, Tier.DISK)]
    worker.take_seqs(1)  # a task report took number 1
    worker.report_events([e for raw in engine_events for e in worker.for_router(raw)])
    (message,) = heard
    assert isinstance(message, wire.CacheEventMsg) and message.worker_index == 2 and not message.snapshot
    assert message.events == [StoreEvent(2, 2, PIC, ("doc",), 8),
                               MoveEvent(2, 3, PIC, ("doc",), 8, Tier.DEVICE, Tier.DISK),
                               EvictEvent(2, 4, PIC, ("doc",), 8, Tier.DISK)]
    assert wire.decode(wire.encode(message)) == message
    assert worker.evictions == CacheCounts(pc=0, pic=1)  # left the device once (the disk tier's eviction is not one)


def test_pc_pages_are_reported_only_as_the_loss_of_the_prompt_segments_they_end():
    worker, heard = leading_worker()
    worker.pc_page_keys = {"page-b": {"chain-1"}, "page-d": {"chain-2"}}  # as pc_events left them
    engine_events = [StoreEvent(2, 1, PC, ("page-e",), 4, parent_key="page-d"),
                     MoveEvent(2, 2, PC, ("page-a", "page-b"), 8, Tier.DEVICE, Tier.HOST),
                     MoveEvent(2, 3, PC, ("page-b",), 4, Tier.HOST, Tier.DISK),
                     EvictEvent(2, 4, PC, ("page-c", "page-d"), 8)]
    worker.report_events([e for raw in engine_events for e in worker.for_router(raw)])
    assert heard[0].events == [EvictEvent(2, 1, PC, ("chain-1",), 0), EvictEvent(2, 2, PC, ("chain-2",), 0)]
    assert worker.evictions == CacheCounts(pc=4, pic=0)  # the pages that left the device


def test_a_cached_prompt_is_reported_one_pc_entry_per_segment_with_that_segments_own_tokens(engine):
    """As the router records a dispatched prompt and the simulator reports one: a segment's PC entry counts its
    own tokens, not the whole prefix through it (which would count the first segment once per later one)."""
    from nebula_engine.engine.kv_port import KVPort
    from nebula_engine.engine.request_port import RequestPort
    from nebula_engine.engine.sampling_params import SamplingParams
    from nebula_engine.pic.segments import PromptSegment, SegmentedPrompt, SegmentKind

    heard: list[wire.Msg] = []
    worker = WorkerService("me", "prefill", 2, KVPort(engine), RequestPort(engine), agent=None,
                           send=lambda peer, msg: heard.append(msg), leader=lambda: "me",
                           pic_key=lambda spec, ids: "key",
                           liveness=Liveness("me", ["me"], dead_after_s=3.0, clock=Clock()))
    prompt = list(range(100, 125))  # 6 full pages of 4 tokens and one more token
    segmented = SegmentedPrompt(tuple(prompt), (PromptSegment(SegmentKind.REGULAR, 0, 8),
                                                PromptSegment(SegmentKind.REGULAR, 8, 12),
                                                PromptSegment(SegmentKind.REGULAR, 20, 5)))

    async def run() -> None:
        async for _ in engine.generate("warm", prompt, SamplingParams(max_tokens=1)):
            pass
        await worker.reporter.pc_events(segmented, None)

    asyncio.run(run())
    (message,) = heard
    # the third segment ends inside a page that is not full, so it is not cached as a prefix
    assert [(e.kind, e.num_tokens) for e in message.events] == [(PC, 8), (PC, 12)]
    assert len({e.keys for e in message.events}) == 2

"""A worker's pins on other peers' KV without processes: the test plays the holder. A pin the worker gave up on must
not stay pinned on its holder when the reply comes late."""

from __future__ import annotations

import asyncio

from builders import Clock

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.liveness import Liveness
from nebula_engine.cluster.runtime.worker import WorkerService
from nebula_engine.engine.async_engine import AsyncLLMEngine
from nebula_engine.engine.kv_port import KVPort
from nebula_engine.engine.request_port import RequestPort
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.pic.segments import PromptSegment, SegmentedPrompt, SegmentKind


def worker_with_dead_holder(engine: AsyncLLMEngine) -> tuple[WorkerService, list]:
    """A worker on ``engine`` whose only other peer, "holder", has been silent past its timeout."""
    clock, sent = Clock(), []
    liveness = Liveness("me", ["me", "holder"], dead_after_s=3.0, clock=clock)
    clock.now += 10.0
    worker = WorkerService("me", "prefill", 0, KVPort(engine), RequestPort(engine), agent=None,
                           send=lambda peer, msg: sent.append((peer, msg)), leader=lambda: "me",
                           pic_key=lambda spec, ids: "key", liveness=liveness)
    return worker, sent


def test_a_late_segment_pin_reply_is_answered_with_an_unpin(engine):
    worker, sent = worker_with_dead_holder(engine)
    segmented = SegmentedPrompt(tuple(range(100, 112)), (PromptSegment(SegmentKind.PIC, 0, 8),
                                                         PromptSegment(SegmentKind.REGULAR, 8, 4)))
    source = wire.SourceSpec(segment_index=0, key="key", peer="holder")

    transfers = []
    copied = asyncio.run(worker.reads.fetch_segment(source, segmented, "epic", transfers))

    assert copied is False and worker.transfer_failures == 1 and transfers == []  # no time for a failed read
    (peer, pin), = sent
    assert peer == "holder" and isinstance(pin, wire.PinSegment)
    worker.on_pin_reply(wire.PinReply(sender="holder", tag=pin.tag, ok=True, pages=[1, 2], state=b""))
    assert sent[-1] == ("holder", wire.Unpin(sender="me", key="key"))
    worker.on_pin_reply(wire.PinReply(sender="holder", tag=pin.tag, ok=True, pages=[1, 2], state=b""))
    assert len(sent) == 2  # one unpin per pin, however often the reply arrives


def test_a_late_prefix_pin_reply_is_answered_with_an_unpin_and_a_refusal_with_nothing(engine):
    worker, sent = worker_with_dead_holder(engine)
    combine = wire.Combine(sender="router", task_id="t", request_id="r", attempt=0, frontend="me",
                           token_ids=list(range(100, 140)), segments=[], params=wire.Params(fields={}),
                           pic_backend=None, sources=[], local_task_ids=[], decode_peer="", prefix_peer="holder",
                           prefix_tokens=32)

    assert asyncio.run(worker.reads.fetch_prefix(combine)) is None
    (_, pin), = sent
    assert isinstance(pin, wire.PinPrefix) and len(pin.token_ids) == 32
    worker.on_pin_reply(wire.PinReply(sender="holder", tag=pin.tag, ok=True, pages=list(range(8))))
    assert sent[-1] == ("holder", wire.UnpinPrefix(sender="me", tag=pin.tag))

    asyncio.run(worker.reads.fetch_prefix(combine))
    refused = sent[-1][1]
    worker.on_pin_reply(wire.PinReply(sender="holder", tag=refused.tag, ok=False))
    assert sent[-1][1] is refused  # nothing was pinned, so nothing is unpinned


class RecordingAgent:
    """Records what the worker tells its transfer agent about reads of its pages."""

    def __init__(self):
        self.expected: list[bool] = []

    def serve_reads(self, expected: bool) -> None:
        self.expected.append(expected)


def test_the_agent_progresses_fast_only_while_a_peer_holds_a_pin(engine):
    port, agent, sent = KVPort(engine), RecordingAgent(), []
    worker = WorkerService("me", "prefill", 0, port, RequestPort(engine), agent=agent,
                           send=lambda peer, msg: sent.append((peer, msg)),
                           leader=lambda: "me", pic_key=lambda spec, ids: "key",
                           liveness=Liveness("me", ["me", "reader"], dead_after_s=3.0))
    ids, prompt = list(range(500, 512)), list(range(520, 540))

    async def pins():
        await port.prefill_segment("epic", ids)
        async for _ in engine.generate("pinned-prefix", prompt, SamplingParams(max_tokens=1)):
            pass
        key = port.segment_key("epic", ids)
        await worker.on_pin(wire.PinSegment(sender="reader", tag="s", key=key, num_tokens=len(ids), wait_s=0.0))
        await worker.on_pin_prefix(wire.PinPrefix(sender="reader", tag="p", token_ids=prompt))
        after_pins = list(agent.expected)
        await worker.on_unpin(wire.Unpin(sender="reader", key=key))
        await worker.on_unpin_prefix(wire.UnpinPrefix(sender="reader", tag="p"))
        return after_pins

    after_pins = asyncio.run(pins())
    assert all(reply.ok for _, reply in sent)
    assert after_pins[0] is False and after_pins[-1] is True  # idle from the start; fast once a peer may read
    assert agent.expected[-1] is False  # every pin released: idle again


def test_a_prefix_pin_waits_for_the_lead_prefilled_here_for_its_reader(engine):
    """A ``ScatterLead`` prefills a prompt's lead here for another peer's combine; that peer's pin of the prefix,
    arriving while the lead is still in the engine, is answered once the lead's pages are cached (all of them),
    and the lead's task is reported done."""
    port, sent, reports = KVPort(engine), [], []
    worker = WorkerService("me", "prefill", 0, port, RequestPort(engine), agent=None,
                           send=lambda peer, msg: reports.append(msg) if peer == "me" else sent.append((peer, msg)),
                           leader=lambda: "me", pic_key=lambda spec, ids: "key",
                           liveness=Liveness("me", ["me", "home"], dead_after_s=3.0))
    prompt_start = list(range(600, 618))  # four full pages and two tokens before the prompt's first PIC segment
    scatter = wire.ScatterLead(sender="router", task_id="r#0/lead", request_id="r", token_ids=prompt_start)
    pin = wire.PinPrefix(sender="home", tag="home/1", token_ids=prompt_start[:16])

    async def lead_and_pin():
        await asyncio.gather(worker.on_scatter_lead(scatter), worker.on_pin_prefix(pin))
        await worker.on_unpin_prefix(wire.UnpinPrefix(sender="home", tag="home/1"))

    asyncio.run(lead_and_pin())
    (peer, reply), = sent
    assert peer == "home" and reply.ok and len(reply.pages) == 4
    assert worker.lead_tokens_prefilled == 16
    assert [m.task_id for m in reports if isinstance(m, wire.TaskDone)] == ["r#0/lead"]
    assert not worker.pins.holds_pins()


def test_a_pin_waiting_for_a_combines_own_cold_segment_is_answered_once_it_is_stored(engine):
    """A combine prefills its cold segments before it runs; another peer, planned to read one of them meanwhile,
    waits for it (``InFlightKeys``). It is answered as soon as the segment is stored, not when the combine ends
    (it waited 0.89 s for a 4,591-token combine in a default compare)."""
    from nebula_engine.engine.kv_gate import KVGate

    port, sent = KVPort(engine), []
    worker = WorkerService("me", "prefill", 0, port, RequestPort(engine), agent=None,
                           send=lambda peer, msg: sent.append((peer, msg)),
                           leader=lambda: "me", pic_key=lambda spec, ids: port.segment_key(spec, ids),
                           liveness=Liveness("me", ["me", "reader"], dead_after_s=3.0))
    ids = list(range(700, 712))
    segmented = SegmentedPrompt(tuple(ids + [5, 6]), (PromptSegment(SegmentKind.PIC, 0, 12),
                                                      PromptSegment(SegmentKind.REGULAR, 12, 2)))
    combine = wire.Combine(sender="router", task_id="t", request_id="r", attempt=0, frontend="me",
                           token_ids=list(segmented.token_ids), segments=[], params=wire.Params(fields={}),
                           pic_backend="epic", sources=[], local_task_ids=[], decode_peer="", compute_here=[0])
    key = port.segment_key("epic", ids)
    local_keys = worker.prefill._local_keys(combine, segmented)
    assert local_keys == {0: key}
    computing = list(local_keys.values())
    worker.in_flight.start(computing)

    async def prefill_then_pin():
        made = await worker.prefill._prefill_here(combine, segmented, KVGate(["prefill"]), computing, local_keys)
        await worker.on_pin(wire.PinSegment(sender="reader", tag="s", key=key, num_tokens=12, wait_s=5.0))
        return made

    assert asyncio.run(prefill_then_pin()) == [0]
    assert computing == [] and key not in worker.in_flight
    (peer, reply), = sent
    assert peer == "reader" and reply.ok and len(reply.pages) == 3

"""The cluster front end without processes: the test plays the leader and the serving peers, and runs every attempt
the front end submits on a real engine. What a client receives must be one unbroken output, whatever dies."""

from __future__ import annotations

import asyncio

import pytest
from builders import Clock

from nebula_engine import SamplingParams
from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.frontend import ClusterFrontend
from nebula_engine.cluster.runtime.liveness import Liveness
from nebula_engine.cluster.runtime.worker_codec import output_to_wire, params_from_wire
from nebula_engine.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineError
from nebula_engine.engine.request_port import RequestPort
from nebula_engine.engine.tokenizer import IncrementalDetokenizer
from nebula_engine.pic.backends import get_pic_backend
from nebula_engine.pic.segments import segment_token_lists

PEERS = ["front", "prefill-0", "prefill-1", "decode-0"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class Harness:
    """One front end ("front"); ``sent`` receives what it sends to peers, in order."""

    def __init__(self, engine: AsyncLLMEngine, leader: str | None = "prefill-0", quorum: bool = True):
        self.engine, self.clock, self.leader, self.quorum = engine, Clock(), leader, quorum
        self.sent: asyncio.Queue = asyncio.Queue()
        self.liveness = Liveness("front", PEERS, dead_after_s=3.0, clock=self.clock)
        self.front = ClusterFrontend("front", RequestPort(engine),
                                     lambda peer, msg: self.sent.put_nowait((peer, msg)),
                                     lambda: self.leader, lambda: self.quorum,
                                     ["prefill-0", "prefill-1"], self.liveness, failover_timeout_s=10.0, max_losses=4)
        self.received: list = []

    def start(self, prompt, params=GREEDY, request_id: str = "r") -> asyncio.Task:
        async def consume():
            async for output in self.front.generate(request_id, prompt, params):
                self.received.append(output)
        return asyncio.ensure_future(consume())

    async def next_message_of(self, kind: type) -> tuple[str, wire.Msg]:
        while True:
            peer, message = await asyncio.wait_for(self.sent.get(), 10)
            if isinstance(message, kind):
                return peer, message

    async def next_submit(self) -> tuple[str, wire.Submit]:
        return await self.next_message_of(wire.Submit)

    async def serve(self, submit: wire.Submit, server: str, limit: int | None = None) -> None:
        """Run ``submit`` on the engine as peer ``server``, passing on at most ``limit`` outputs."""
        stream = self.engine.generate(f"{submit.request_id}#{submit.attempt}", submit.token_ids,
                                      params_from_wire(submit.params))
        count = 0
        async for output in stream:
            self.liveness.heard(server)
            self.front.on_output(output_to_wire(server, submit.request_id, output, submit.attempt))
            count += 1
            if count == limit:
                await stream.aclose()
                return
            await asyncio.sleep(0)  # let the client side read it

    def kill(self, peer: str) -> None:
        """``peer`` stops answering: the peer timeout passes without a word from it."""
        self.clock.now += self.liveness.dead_after_s + 0.5
        for other in PEERS:
            if other != peer:
                self.liveness.heard(other)
        self.front.check()


def check_unbroken(received, expected_ids, expected_text):
    texts = [o.outputs[0].text for o in received]
    counts = [len(o.outputs[0].token_ids) for o in received]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:])), texts
    assert counts == sorted(counts) and len(set(counts)) == len(counts), counts
    assert [o.finished for o in received] == [False] * (len(received) - 1) + [True]
    assert received[-1].outputs[0].token_ids == expected_ids
    assert received[-1].outputs[0].text == expected_text


def test_a_request_whose_decode_peer_dies_continues_from_its_streamed_tokens(engine):
    prompt = engine.tokenizer.encode("The owl sat on the branch and")

    async def scenario():
        harness = Harness(engine)
        reference = [o async for o in engine.generate("reference", prompt, GREEDY)][-1].outputs[0]
        client = harness.start(prompt)
        leader, first = await harness.next_submit()
        assert leader == "prefill-0" and first.attempt == 0 and first.token_ids == prompt
        await harness.serve(first, "decode-0", limit=5)
        harness.kill("decode-0")
        _, again = await harness.next_submit()
        assert again.attempt == 1 and again.token_ids == prompt + reference.token_ids[:5]
        assert params_from_wire(again.params).max_tokens == GREEDY.max_tokens - 5
        assert again.segments[-1] == wire.Segment("regular", len(prompt), 5)
        await harness.serve(again, "prefill-1")
        await client
        check_unbroken(harness.received, reference.token_ids, reference.text)
        assert harness.received[-1].prompt_token_ids == prompt  # usage counts the client's prompt
        assert harness.front.num_resubmitted == 1

    asyncio.run(scenario())


def test_a_request_is_run_again_when_the_decode_peer_it_was_handed_to_dies_before_its_first_output(engine):
    prompt = engine.tokenizer.encode("Five six seven")

    async def scenario():
        harness = Harness(engine)
        client = harness.start(prompt)
        _, first = await harness.next_submit()
        first_token = wire.Output(sender="prefill-0", request_id="r", attempt=0, text="x", token_ids=[87],
                                  logprobs=[0.0], finished=False, finish_reason=None, stop_reason=None,
                                  cached=[0, 0, 0], handoff_to="decode-0")
        harness.front.on_output(first_token)
        harness.kill("decode-0")  # the prefill peer lives on: it released the request to decode-0
        _, again = await harness.next_submit()
        assert again.attempt == 1 and again.token_ids == prompt + [87]
        client.cancel()

    asyncio.run(scenario())


def test_late_outputs_of_a_lost_attempt_are_ignored(engine):
    prompt = engine.tokenizer.encode("One two three")

    async def scenario():
        harness = Harness(engine)
        client = harness.start(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        _, first = await harness.next_submit()
        harness.front.on_output(wire.Failed(sender="prefill-0", request_id="r", attempt=0, message="prefill-1 died",
                                            client_error=False, resumable=True))
        _, again = await harness.next_submit()
        await harness.serve(first, "decode-0")  # the lost attempt was not dead after all: ignored
        assert harness.received == []
        await harness.serve(again, "prefill-1")
        await client
        assert len(harness.received[-1].outputs[0].token_ids) == 4

    asyncio.run(scenario())


def test_a_stop_string_spanning_the_seam_stops_the_request(engine):
    tokenizer = engine.tokenizer
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=["world"])
    before, after = tokenizer.encode("Hello wor"), tokenizer.encode("ld and more")

    async def scenario():
        harness = Harness(engine)
        client = harness.start(tokenizer.encode("Say it:"), params)
        _, first = await harness.next_submit()
        harness.front.on_output(wire.Output(sender="decode-0", request_id="r", attempt=0, text="Hello wor",
                                            token_ids=before, logprobs=[0.0] * len(before), finished=False,
                                            finish_reason=None, stop_reason=None, cached=[0, 0, 0]))
        await asyncio.sleep(0)
        harness.kill("decode-0")
        _, again = await harness.next_submit()
        harness.front.on_output(wire.Output(sender="prefill-1", request_id="r", attempt=1, text="ld and more",
                                            token_ids=after, logprobs=[0.0] * len(after), finished=False,
                                            finish_reason=None, stop_reason=None, cached=[0, 0, 0]))
        await client
        final = harness.received[-1]
        assert final.finished and final.outputs[0].text == "Hello "
        assert (final.outputs[0].finish_reason, final.outputs[0].stop_reason) == ("stop", "world")
        peer, abort = await harness.next_message_of(wire.Abort)
        assert peer == "prefill-1" and abort.request_id == "r"

    asyncio.run(scenario())


def test_tokens_of_an_unfinished_character_are_generated_again(engine):
    tokenizer = engine.tokenizer
    ids = tokenizer.encode("owl \U0001F989")
    cut = next(n for n in range(len(ids) - 1, 0, -1) if not tokenizer.decode(ids[:n]).endswith("\ufffd"))
    assert cut < len(ids) - 1, "the test needs a character spread over several tokens"
    partial = ids[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    text = "".join(detokenizer.add_token(t) for t in partial)  # what the peer had streamed: no half character

    async def scenario():
        harness = Harness(engine)
        client = harness.start(tokenizer.encode("Draw:"), SamplingParams(max_tokens=20, temperature=0.0))
        _, first = await harness.next_submit()
        harness.front.on_output(wire.Output(sender="decode-0", request_id="r", attempt=0, text=text,
                                            token_ids=partial, logprobs=[0.0] * len(partial), finished=False,
                                            finish_reason=None, stop_reason=None, cached=[0, 0, 0]))
        harness.kill("decode-0")
        _, again = await harness.next_submit()
        assert again.token_ids == first.token_ids + ids[:cut]
        client.cancel()

    asyncio.run(scenario())


def test_without_quorum_a_request_fails_at_once_and_health_says_so(engine):
    async def scenario():
        harness = Harness(engine, leader=None, quorum=False)
        assert not harness.front.stats().alive
        with pytest.raises(EngineDeadError, match="cannot reach a majority"):
            await anext(harness.front.generate("r", [5, 6, 7], GREEDY))

    asyncio.run(scenario())


def test_a_request_waits_for_an_election_but_not_longer_than_the_failover_timeout(engine):
    async def scenario():
        harness = Harness(engine, leader=None, quorum=True)
        assert harness.front.stats().alive  # an election is on: requests wait for it
        elected = harness.start([5, 6, 7], request_id="elected")
        orphan = harness.start([5, 6, 8], request_id="orphan")
        await asyncio.sleep(0)
        harness.clock.now += 5
        harness.front.check()
        assert harness.sent.empty()
        harness.leader = "prefill-1"
        harness.front.on_leader_change("prefill-1")
        submitted = {(await harness.next_submit())[1].request_id for _ in range(2)}
        assert submitted == {"elected", "orphan"}
        harness.leader = None
        harness.front.on_leader_change(None)
        harness.kill("prefill-1")  # the new leader dies too, before either request produced anything
        harness.clock.now += 10
        harness.front.check()
        for task in (elected, orphan):
            with pytest.raises(EngineDeadError, match="no leader could take the request"):
                await task

    asyncio.run(scenario())


def test_a_refused_submission_goes_to_the_leader_again_and_errors_reach_the_client(engine):
    async def scenario():
        harness = Harness(engine)
        client = harness.start([5, 6, 7])
        _, first = await harness.next_submit()
        harness.front.on_not_leader(wire.NotLeader(sender="prefill-0", request_id="r", attempt=first.attempt))
        harness.front.check()
        _, again = await harness.next_submit()
        harness.front.on_output(wire.Failed(sender="prefill-0", request_id="r", attempt=again.attempt,
                                            message="bad backend for this model", client_error=True))
        with pytest.raises(ValueError, match="bad backend"):
            await client
        lost = harness.start([5, 6, 7], request_id="lost")
        for _ in range(5):
            _, submit = await harness.next_submit()
            harness.front.on_output(wire.Failed(sender="prefill-0", request_id="lost", attempt=submit.attempt,
                                                message="again", client_error=False, resumable=True))
        with pytest.raises(EngineError, match="lost 5 times"):
            await lost

    asyncio.run(scenario())


@pytest.mark.parametrize("asked, sent", [({}, "prophet"), (dict(pic_backend=None), None),
                                         (dict(pic_backend="cacheblend:ratio=0.3"), "cacheblend:ratio=0.3")])
def test_the_submission_carries_the_backend_admission_resolved(engine, asked, sent):
    """No spec: the front end's engine default ("auto" is prophet on this attention-only model), named so that every
    peer reads the same backend."""
    async def scenario():
        harness = Harness(engine)
        prompt = segment_token_lists([("regular", [5]), ("pic", [9] * 8)])
        client = asyncio.ensure_future(anext(harness.front.generate("r", prompt, GREEDY, **asked)))
        _, submit = await harness.next_submit()
        client.cancel()
        with pytest.raises(asyncio.CancelledError):
            await client
        return submit

    spec = asyncio.run(scenario()).pic_backend
    assert spec == sent if sent is None else get_pic_backend(spec) == get_pic_backend(sent)


def test_a_bad_backend_spec_is_refused_before_submission(engine):
    async def scenario():
        harness = Harness(engine)
        with pytest.raises(ValueError, match="unknown PIC backend"):
            await anext(harness.front.generate("r", [5, 6, 7], GREEDY, pic_backend="blend"))
        assert harness.sent.empty()

    asyncio.run(scenario())


def test_new_sampling_fields_survive_the_wire():
    from nebula_engine.cluster.runtime.worker_codec import params_to_wire
    from nebula_engine.engine.structured_outputs import StructuredOutputsParams

    params = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.2, repetition_penalty=1.1, min_p=0.1,
                            min_tokens=2, logit_bias={7: 3.0}, stop=["x"],
                            structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    decoded = wire.decode(wire.encode(wire.Submit(sender="f", request_id="r", attempt=0, token_ids=[1], segments=[],
                                                  params=params_to_wire(params), pic_backend="")))
    assert params_from_wire(decoded.params) == params

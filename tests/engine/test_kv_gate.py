"""A request queued behind a KV gate (a cluster combine whose remote KV is still arriving) keeps its place, lets
later requests pass without counting them, is scheduled once the gate opens, and an engine holding only gated
requests does not step."""

from __future__ import annotations

import asyncio
import threading

import pytest

from nebula_engine import SamplingParams
from nebula_engine.config import EngineConfig
from nebula_engine.engine.admission import admit
from nebula_engine.engine.async_engine import AsyncLLMEngine
from nebula_engine.engine.kv_gate import KVGate
from nebula_engine.engine.kv_plan import KVPlan
from nebula_engine.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SETTINGS = dict(num_pages=128, page_size=8)


def test_a_gate_opens_once_every_part_has_arrived_and_wakes_its_engine_once():
    woken = []
    gate = KVGate(["reads", "prefill"])
    gate.on_open = lambda: woken.append(True)
    gate.open("reads")
    gate.open("reads")  # again: nothing
    assert not gate.is_open and woken == []
    gate.open("prefill")
    assert gate.is_open and woken == [True]
    gate.open("prefill")
    assert woken == [True]
    assert KVGate([]).is_open


def test_a_gated_request_keeps_its_place_and_is_scheduled_when_its_gate_opens(qwen3_dir):
    engine = LLMEngine(EngineConfig.create(str(qwen3_dir), **SETTINGS))
    expected = {}
    for request_id, prompt in (("gated", [11, 12, 13, 14, 15]), ("later", [21, 22, 23])):
        engine.add_request(f"ref-{request_id}", prompt, GREEDY)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    expected[request_id] = output.outputs[0].token_ids
    gate = KVGate(["reads"])
    engine.add_admitted("gated", admit(engine, [11, 12, 13, 14, 15], GREEDY, None), KVPlan(gate=gate))
    engine.add_request("later", [21, 22, 23], GREEDY)
    finished = {}
    while "later" not in finished:  # the later request runs to the end past the gated one
        assert engine.has_schedulable_requests()
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    gated = engine.scheduler.waiting[0]
    assert gated.seq_id == "gated" and gated.num_computed_tokens == 0 and gated.num_times_passed == 0
    assert engine.has_unfinished_requests() and not engine.has_schedulable_requests()
    gate.open("reads")
    assert engine.has_schedulable_requests()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert finished == expected


class CountingEngine(LLMEngine):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.steps = 0

    def step(self):
        self.steps += 1
        return super().step()


@pytest.fixture()
def async_engine(qwen3_dir):
    engine = AsyncLLMEngine(CountingEngine(EngineConfig.create(str(qwen3_dir), **SETTINGS)))
    yield engine
    engine.shutdown()


def test_an_engine_holding_only_a_gated_request_sleeps_until_the_gate_opens(async_engine):
    gate = KVGate(["reads"])

    async def scenario():
        gated = asyncio.ensure_future(_last(async_engine, "gated", [11, 12, 13, 14, 15], gate))
        plain = await _last(async_engine, "plain", [21, 22, 23])
        steps = async_engine.engine.steps
        for _ in range(3):  # each call is a command the loop wakes for: a loop that stepped would step now
            await async_engine.call(lambda engine: None)
        assert async_engine.engine.steps == steps and not gated.done()
        opener = threading.Thread(target=gate.open, args=("reads",))  # as a transfer thread would
        opener.start()
        opener.join()
        return plain, await gated

    plain, gated = asyncio.run(scenario())
    assert plain.finished and gated.finished and len(gated.outputs[0].token_ids) == GREEDY.max_tokens


async def _last(engine: AsyncLLMEngine, request_id: str, prompt: list[int], gate: KVGate | None = None):
    last = None
    async for last in engine.generate(request_id, prompt, GREEDY, None, kv_plan=KVPlan(gate=gate)):
        pass
    return last

"""AsyncLLMEngine: concurrent streams equal offline generation; validation, abort, engine failure, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from nebula_engine import SamplingParams
from nebula_engine.config import EngineConfig
from nebula_engine.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineError
from tests.server.conftest import ENGINE_SETTINGS, ObservedEngine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)  # runs until aborted or failed


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    observed = ObservedEngine(EngineConfig.create(str(qwen3_dir), **ENGINE_SETTINGS))
    async_engine = AsyncLLMEngine(observed)
    yield async_engine
    async_engine.shutdown()


async def collect(engine: AsyncLLMEngine, request_id: str, prompt, params=GREEDY) -> list:
    return [output async for output in engine.generate(request_id, prompt, params)]


def test_concurrent_streams_equal_offline_generate(engine, reference_llm):
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode(text) for text in ("Hello there", "One two three four five", "x")]

    async def run_all():
        return await asyncio.gather(*(collect(engine, f"c{i}", p) for i, p in enumerate(prompts)))

    streams = asyncio.run(run_all())
    reference = reference_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for outputs, expected in zip(streams, reference):
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        token_counts = [len(o.outputs[0].token_ids) for o in outputs]
        assert token_counts == list(range(1, GREEDY.max_tokens + 1))  # cumulative, one token per step
        assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
        assert outputs[-1].outputs[0].text == expected.outputs[0].text
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


def test_invalid_requests_raise_in_the_caller(engine):
    async def first(request_id, prompt, params=GREEDY):
        return await anext(engine.generate(request_id, prompt, params))

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(first("bad-empty", []))
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(first("bad-long", [5] * engine.max_model_len))
    with pytest.raises(ValueError, match="vocabulary"):
        asyncio.run(first("bad-vocab", [10 ** 9]))

    async def duplicate_id():
        running = engine.generate("dup", [5, 6, 7], LONG)
        await anext(running)
        try:
            with pytest.raises(ValueError, match="already in use"):
                await first("dup", [5, 6, 7])
        finally:
            await running.aclose()

    asyncio.run(duplicate_id())
    assert len(asyncio.run(collect(engine, "after-bad", [5, 6, 7]))) == GREEDY.max_tokens


def test_closing_a_stream_early_aborts_the_request_in_the_engine(engine):
    observed = engine.engine
    observed.abort_seen.clear()

    async def read_one_then_leave():
        stream = engine.generate("leaver", [5, 6, 7, 8], LONG)
        first = await anext(stream)
        await stream.aclose()
        return first

    assert not asyncio.run(read_one_then_leave()).finished
    assert observed.abort_seen.wait(timeout=30)
    assert ("leaver", True) in observed.aborted  # it was still live in the engine when stopped
    assert len(asyncio.run(collect(engine, "after-leaver", [5, 6, 7]))) == GREEDY.max_tokens


def test_engine_failure_fails_requests_in_flight_and_keeps_serving(engine, reference_llm):
    async def fail_mid_stream():
        stream = engine.generate("victim", [9, 10, 11], LONG)
        await anext(stream)
        engine.engine.fail_next_step()
        with pytest.raises(EngineError, match="injected device failure"):
            async for _ in stream:
                pass

    asyncio.run(fail_mid_stream())
    outputs = asyncio.run(collect(engine, "survivor", [9, 10, 11]))
    [expected] = reference_llm.generate({"prompt_token_ids": [9, 10, 11]}, GREEDY)
    assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids


def test_shutdown_fails_requests_in_flight_and_refuses_new_ones(qwen3_dir):
    engine = AsyncLLMEngine.from_config(EngineConfig.create(str(qwen3_dir), **ENGINE_SETTINGS))

    async def shut_down_mid_stream():
        stream = engine.generate("cut", [5, 6, 7], LONG)
        await anext(stream)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await anext(engine.generate("late", [5, 6, 7], GREEDY))

    asyncio.run(shut_down_mid_stream())
    assert not engine.stats().alive
    assert not engine.engine.has_unfinished_requests()


def test_a_request_failing_inside_a_step_ends_alone_while_concurrent_streams_complete(engine, reference_llm):
    poisoned = SamplingParams(max_tokens=20, temperature=0.7, seed=1)
    object.__setattr__(poisoned, "seed", 2 ** 64)  # past validation: its sampler state cannot be built
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    async def poisoned_request():
        with pytest.raises(EngineError, match="Overflow"):
            await collect(engine, "poisoned", [14, 15, 16], poisoned)

    async def run_all():
        streams = [collect(engine, f"ok{i}", p, params) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*streams[:2], poisoned_request(), *streams[2:])
        return results[:2] + results[3:]

    streams = asyncio.run(run_all())
    reference = reference_llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for outputs, expected in zip(streams, reference):
        assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 21))  # every token, in order
        assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert engine.stats().num_running == 0


def test_streams_carry_n_completions_and_logprobs(engine, reference_llm):
    prompt = engine.tokenizer.encode("One two three")
    params = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=4, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    outputs = asyncio.run(collect(engine, "n-logprobs", prompt, params))
    final = outputs[-1]
    expected = reference_llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert final.finished and [c.index for c in final.outputs] == [0, 1]
    for got, want in zip(final.outputs, expected.outputs):
        assert got.token_ids == want.token_ids and len(got.logprobs) == 5
        assert [list(d) for d in got.logprobs] == [list(d) for d in want.logprobs]
    for output in outputs:  # every streamed item: each completion so far, its logprobs as long as its tokens
        assert all(len(c.logprobs) == len(c.token_ids) for c in output.outputs)
    assert len(final.prompt_logprobs) == len(prompt) and final.prompt_logprobs[0] is None
    assert engine.stats().num_running == 0


def test_structured_requests_stream_and_invalid_schemas_raise_in_the_caller(engine):
    import json

    from nebula_engine import StructuredOutputsParams

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=2,
                            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    outputs = asyncio.run(collect(engine, "json", engine.tokenizer.encode("Answer:"), params))
    assert json.loads(outputs[-1].outputs[0].text) in ({"ok": True}, {"ok": False})
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "objekt"}))
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        asyncio.run(collect(engine, "bad-json", [5, 6, 7], bad))

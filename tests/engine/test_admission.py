"""Admission: one function checks a request against the engine and resolves its PIC backend; what it admits is
queued as it is (never checked again), offline and behind the async engine alike."""

import asyncio
import dataclasses

import pytest

from nebula_engine import SamplingParams
from nebula_engine.engine import admission
from nebula_engine.engine.admission import ENGINE_DEFAULT, AdmittedRequest, admit
from nebula_engine.engine.async_engine import AsyncLLMEngine
from nebula_engine.pic.backends import get_pic_backend
from nebula_engine.pic.segments import segment_token_lists

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
SEGMENTED = segment_token_lists([("regular", [5, 6]), ("pic", list(range(100, 116))), ("regular", [7, 8])])


def test_admission_resolves_the_backend_spec(llm):
    engine = llm.llm_engine
    assert admit(engine, [5, 6, 7], GREEDY).backend is engine.pic_backend  # no spec: the engine's
    assert admit(engine, [5, 6, 7], GREEDY, ENGINE_DEFAULT).backend is engine.pic_backend
    assert admit(engine, [5, 6, 7], GREEDY, None).backend is None  # PIC off
    assert admit(engine, SEGMENTED, GREEDY, "cacheblend:ratio=0.3").backend == get_pic_backend("cacheblend:ratio=0.3")
    with pytest.raises(ValueError, match="unknown PIC backend 'blend'"):
        admit(engine, SEGMENTED, GREEDY, "blend")


def test_the_resolved_backend_spec_names_the_same_backend(llm):
    """The cluster front end puts ``backend.spec`` on the wire; every peer must read the backend it resolved."""
    engine = llm.llm_engine
    for spec in (ENGINE_DEFAULT, "cacheblend:ratio=0.3", "epic"):
        backend = admit(engine, SEGMENTED, GREEDY, spec).backend
        assert engine.resolve_request_backend(backend.spec) == backend


def test_an_admitted_request_is_frozen_and_keeps_the_prompt(llm):
    request = admit(llm.llm_engine, SEGMENTED, GREEDY, text="the text")
    assert request.token_ids == SEGMENTED.token_ids and request.segmented is SEGMENTED
    assert request.params is GREEDY and request.text == "the text"
    plain = admit(llm.llm_engine, [5, 6, 7], GREEDY)
    assert plain.token_ids == (5, 6, 7) and plain.segmented is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.params = SamplingParams()


@pytest.mark.parametrize("prompt, params, message", [
    ([], GREEDY, "prompt is empty"),
    ([5, 10**9], GREEDY, r"prompt token id\(s\) \[1000000000\] outside the vocabulary"),
    ([5] * 10_000, GREEDY, "leaves no room to generate"),
    ([5], {"max_tokens": 3}, "sampling params must be SamplingParams, got dict"),
    ([5], SamplingParams(stop_token_ids=[10**9]), r"stop_token_ids \[1000000000\] outside the vocabulary"),
    ([5], SamplingParams(logit_bias={10**9: 1.0}), "logit_bias token id"),
])
def test_admission_refuses_what_the_engine_cannot_serve(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        admit(llm.llm_engine, prompt, params)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.fixture
def admissions(monkeypatch):
    """Counts the prompts admission checks (every path admits through ``admission.admit``)."""
    checked = []
    check = admission._check_prompt
    monkeypatch.setattr(admission, "_check_prompt", lambda engine, ids: (checked.append(list(ids)), check(engine, ids)))
    return checked


def test_offline_requests_are_checked_once(llm, admissions):
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"segments": [("regular", [5]), ("pic", [9] * 16)]}],
                           GREEDY, use_tqdm=False)
    assert len(outputs) == 2 and len(admissions) == 2


def test_requests_behind_the_async_engine_are_checked_once(llm, admissions):
    async def scenario():
        engine = AsyncLLMEngine(llm.llm_engine)
        try:
            return [o async for o in engine.generate("r", [5, 6, 7], GREEDY)][-1]
        finally:
            engine.shutdown()

    assert asyncio.run(scenario()).finished and admissions == [[5, 6, 7]]


def test_add_admitted_takes_the_request_as_it_is(llm, admissions):
    engine = llm.llm_engine
    request = AdmittedRequest((5, 6, 7), None, GREEDY, None)  # built by hand: nothing checks it again
    engine.add_admitted("as-is", request)
    try:
        assert admissions == [] and engine.has_unfinished_requests()
    finally:
        engine.abort_request("as-is")

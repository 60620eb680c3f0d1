"""Approximate K/V never answers an exact request: the prefix cache knows which pages a
plain prefill would have computed and which a PIC backend's combine approximated, and hands each request only
K/V its own backend setting would have produced."""

from __future__ import annotations

import pytest

from nebula_engine import LLM
from nebula_engine.engine.sampling_params import SamplingParams
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)
from tests.pic.test_backends_exact import flat, rag_prompt

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SETTINGS = dict(page_size=4, num_pages=512)
SYSTEM_PAGES_TOKENS = 8  # rag_prompt's 9-token system prompt fills two exact pages before the first document
WHOLE_PROMPT_PAGES_TOKENS = 76  # every full page before the last of its 81 tokens


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"]))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Plain prefill of each prompt, with no cache at all."""
    llm = LLM(checkpoint, enable_prefix_caching=False, **SETTINGS)
    return lambda segments: llm.generate({"prompt_token_ids": flat(segments)}, GREEDY, pic_backend=None)[0]


def assert_same_output(output, reference_output) -> None:
    assert output.prompt_token_ids == reference_output.prompt_token_ids
    assert output.outputs[0].token_ids == reference_output.outputs[0].token_ids
    assert output.outputs[0].logprobs == pytest.approx(reference_output.outputs[0].logprobs, abs=1e-4)


@pytest.mark.parametrize("spec", ["naive", "epic:k=2", "cacheblend:ratio=0.25"])
def test_pic_off_request_after_an_approximate_one_gets_plain_prefill(checkpoint, reference, spec):
    llm = LLM(checkpoint, **SETTINGS)
    prompt = rag_prompt(seed=6, order=(2, 0, 1))
    llm.generate({"segments": rag_prompt(seed=6)}, GREEDY, pic_backend=spec)  # segments cached in another order
    pic = llm.generate({"segments": prompt}, GREEDY, pic_backend=spec)[0]
    assert pic.num_pic_cached_tokens == 64 and pic.num_recomputed_tokens < 64  # approximate K/V made
    exact = llm.generate({"segments": prompt}, GREEDY, pic_backend=None)[0]
    # the system prompt's pages are exact and still shared; nothing from the first document on is
    assert exact.num_prefix_cached_tokens == SYSTEM_PAGES_TOKENS and exact.num_pic_cached_tokens == 0
    assert_same_output(exact, reference(prompt))
    llm.llm_engine.scheduler.prefix_cache.cache.check_integrity()


def test_same_backend_reuses_its_own_approximate_pages_another_does_not(checkpoint):
    llm = LLM(checkpoint, **SETTINGS)
    prompt = rag_prompt(seed=7)
    first = llm.generate({"segments": prompt}, GREEDY, pic_backend="naive")[0]
    again = llm.generate({"segments": prompt}, GREEDY, pic_backend="naive")[0]
    assert again.num_prefix_cached_tokens == WHOLE_PROMPT_PAGES_TOKENS and again.num_pic_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm.generate({"segments": prompt}, GREEDY, pic_backend="epic:k=2")[0]
    assert other.num_prefix_cached_tokens == SYSTEM_PAGES_TOKENS and other.num_pic_cached_tokens == 64
    exact_backend = llm.generate({"segments": prompt}, GREEDY, pic_backend="full")[0]
    assert exact_backend.num_prefix_cached_tokens == SYSTEM_PAGES_TOKENS


def test_exact_pages_are_shared_with_every_backend(checkpoint, reference):
    """K/V a plain prefill made (or a backend at its exact setting) is exact: PIC off and PIC requests take it."""
    llm = LLM(checkpoint, **SETTINGS)
    prompt = rag_prompt(seed=8, order=(1, 2, 0))
    llm.generate({"segments": prompt}, GREEDY, pic_backend="full")  # every reused token recomputed: exact
    exact = llm.generate({"segments": prompt}, GREEDY, pic_backend=None)[0]
    assert exact.num_prefix_cached_tokens == WHOLE_PROMPT_PAGES_TOKENS
    assert_same_output(exact, reference(prompt))
    approximate = llm.generate({"segments": prompt}, GREEDY, pic_backend="naive")[0]
    assert approximate.num_prefix_cached_tokens == WHOLE_PROMPT_PAGES_TOKENS  # exact K/V is good for any backend
    assert_same_output(approximate, reference(prompt))


def test_decode_pages_after_an_approximate_prompt_stay_approximate(checkpoint, reference):
    """A greedy continuation attends to the approximate prompt: its pages must not become exact either."""
    llm = LLM(checkpoint, **SETTINGS)
    prompt = rag_prompt(seed=9, order=(2, 1, 0))
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    made = llm.generate({"segments": prompt}, long, pic_backend="naive")[0]
    continued = flat(prompt) + list(made.outputs[0].token_ids)
    exact = llm.generate({"prompt_token_ids": continued}, GREEDY, pic_backend=None)[0]
    assert exact.num_prefix_cached_tokens == SYSTEM_PAGES_TOKENS

"""The PIC combines of one engine step run as one forward when their requests share a backend: each request, its
segment orders, prefix and question of its own, gets the tokens and logprobs it gets combined alone."""

from __future__ import annotations

import random

import pytest

from nebula_engine import LLM
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.pic.segments import segment_token_lists
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BACKENDS = ("full", "naive", "epic:k=3", "cacheblend:ratio=0.3", "cacheblend:check_layers=0/1,ratios=0.5/0.25",
            "a3:ratio=0.4", "a3:ratio=0.4,softmax=context", "prophet:ratio=0.4", "prophet:ratio=0.4,queries=last")
CASES = ("qwen3_gqa2_hd20", "mistral_sliding_window6", "deepseek_v2_lite_greedy_yarn")


def requests(seed: int) -> list[list[tuple[str, list[int]]]]:
    """Four RAG prompts over one set of documents: different orders, a system prompt or none, own questions."""
    rng = random.Random(seed)
    docs = [[rng.randrange(100, 1000) for _ in range(n)] for n in (17, 9, 23, 12)]
    system = [rng.randrange(100, 1000) for _ in range(7)]
    prompts = []
    for order, lead in [((0, 1, 2), system), ((2, 0, 3), system), ((3, 1), []), ((1, 3, 0, 2), system[:3])]:
        question = [rng.randrange(100, 1000) for _ in range(rng.randrange(3, 8))]
        prompts.append(([("regular", lead)] if lead else []) + [("pic", docs[i]) for i in order]
                       + [("regular", question)])
    return prompts


@pytest.fixture(scope="module")
def engines(checkpoint_factory):
    cache = {}

    def get(name):
        if name not in cache:  # no prefix caching: every request runs a combine
            cache[name] = LLM(str(checkpoint_factory(CASES_BY_NAME[name])), page_size=4, num_pages=512,
                              enable_prefix_caching=False)
        return cache[name]
    return get


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("spec", BACKENDS)
def test_a_steps_combines_share_one_forward_and_match_each_alone(engines, name, spec):
    llm = engines(name)
    stats = llm.llm_engine.model_runner.pic_executor.stats
    prompts = [{"segments": segments} for segments in requests(seed=len(spec))]
    llm.generate(prompts, GREEDY, pic_backend=spec)  # every segment cached: both runs below reuse the same KV
    alone = [llm.generate(prompt, GREEDY, pic_backend=spec)[0] for prompt in prompts]
    combines, forwards = stats.combines, stats.combine_forwards
    together = llm.generate(prompts, GREEDY, pic_backend=spec)
    assert stats.combines - combines == len(prompts)
    assert stats.combine_forwards - forwards == 1
    for one, batched in zip(alone, together):
        assert batched.num_pic_cached_tokens == one.num_pic_cached_tokens > 0
        assert batched.num_recomputed_tokens == one.num_recomputed_tokens
        assert batched.outputs[0].token_ids == one.outputs[0].token_ids
        assert batched.outputs[0].token_logprobs == pytest.approx(one.outputs[0].token_logprobs, abs=1e-4)


def test_requests_with_different_backends_in_one_step_run_one_forward_per_backend(engines):
    llm = engines("qwen3_gqa2_hd20")
    stats = llm.llm_engine.model_runner.pic_executor.stats
    prompts = [{"segments": segments} for segments in requests(seed=3)]
    specs = ["epic:k=3", "cacheblend:ratio=0.3", "epic:k=3", "cacheblend:ratio=0.3"]
    llm.generate(prompts, GREEDY, pic_backend="epic:k=3")
    llm.generate(prompts, GREEDY, pic_backend="cacheblend:ratio=0.3")
    alone = [llm.generate(prompt, GREEDY, pic_backend=spec)[0] for prompt, spec in zip(prompts, specs)]
    forwards = stats.combine_forwards
    engine = llm.llm_engine
    for index, (prompt, spec) in enumerate(zip(prompts, specs)):
        engine.add_request(f"mixed-{index}", segment_token_lists(prompt["segments"]), GREEDY, pic_backend=spec)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert stats.combine_forwards - forwards == 2
    for index, one in enumerate(alone):
        assert outputs[f"mixed-{index}"].outputs[0].token_ids == one.outputs[0].token_ids

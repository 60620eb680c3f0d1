"""PIC backends through the engine: exact settings reproduce plain prefill on every family, reuse works
across segment orders, and backends refuse what they cannot serve."""

from __future__ import annotations

import random

import pytest

from nebula_engine import LLM
from nebula_engine.engine.sampling_params import SamplingParams
from tests.model_cases import HYBRID_AND_MLA_CASES, MODEL_CASES, checkpoint_factory  # noqa: F401  (fixture)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ATTENTION_EXACT = ("full", "cacheblend:ratio=1.0", "cacheblend:ratio=1.0,weight=question", "epic:k=100000",
                   "a3:ratio=1.0", "prophet:ratio=1.0")
CASES = [(case, spec) for case in MODEL_CASES + HYBRID_AND_MLA_CASES
         for spec in (("hypic:seam=100000",) if case.family.startswith("qwen3_5") else ATTENTION_EXACT)]


def rag_prompt(seed: int, order=(0, 1, 2)) -> list[tuple[str, list[int]]]:
    """System prompt + three documents (PIC) in ``order`` + question, as explicit segments."""
    rng = random.Random(seed)
    system = [rng.randrange(100, 1000) for _ in range(9)]
    docs = [[rng.randrange(100, 1000) for _ in range(n)] for n in (21, 13, 30)]
    question = [rng.randrange(100, 1000) for _ in range(5)]
    return [("regular", system)] + [("pic", docs[i]) for i in order] + [("regular", question)]


def flat(segments) -> list[int]:
    return [t for _, ids in segments for t in ids]


@pytest.fixture(scope="module")
def engines(checkpoint_factory):
    """One engine per model case, without prefix caching: every PIC request runs a combine."""
    cache = {}

    def get(case):
        if case.name not in cache:
            cache[case.name] = LLM(str(checkpoint_factory(case)), page_size=4, num_pages=512,
                                   enable_prefix_caching=False)
        return cache[case.name]
    return get


def case_id(case, spec: str) -> str:
    return f"{case.name}-{spec.split(':')[0]}" + ("-weighted" if "weight=" in spec else "")


@pytest.mark.parametrize("case,spec", CASES, ids=[case_id(c, s) for c, s in CASES])
def test_exact_settings_equal_plain_prefill(engines, case, spec):
    llm = engines(case)
    target = rag_prompt(seed=1, order=(2, 0, 1))
    plain = llm.generate({"prompt_token_ids": flat(target)}, GREEDY, pic_backend=None)[0]
    llm.generate({"segments": rag_prompt(seed=1)}, GREEDY, pic_backend=spec)  # caches the segments elsewhere
    pic = llm.generate({"segments": target}, GREEDY, pic_backend=spec)[0]
    assert pic.prompt_token_ids == plain.prompt_token_ids
    assert pic.num_pic_cached_tokens == 64 and pic.num_recomputed_tokens == 64
    assert pic.outputs[0].token_ids == plain.outputs[0].token_ids
    assert pic.outputs[0].token_logprobs == pytest.approx(plain.outputs[0].token_logprobs, abs=1e-4)


@pytest.mark.parametrize("case", [c for c in MODEL_CASES if c.name in ("mistral_gqa2", "qwen3_gqa2_hd20")]
                         + [c for c in HYBRID_AND_MLA_CASES if c.family in ("deepseek_v2", "qwen3_5")][:2],
                         ids=str)
def test_reuse_without_recompute_is_not_exact(engines, case):
    """The exactness check can fail: reusing segments computed alone, unrepaired, changes the logits."""
    llm = engines(case)
    spec = "hypic:seam=3" if case.family.startswith("qwen3_5") else "naive"
    target = rag_prompt(seed=2, order=(1, 2, 0))
    plain = llm.generate({"prompt_token_ids": flat(target)}, GREEDY, pic_backend=None)[0]
    pic = llm.generate({"segments": target}, GREEDY, pic_backend=spec)[0]
    assert pic.num_pic_cached_tokens > 0
    assert max(abs(a - b) for a, b in zip(pic.outputs[0].token_logprobs, plain.outputs[0].token_logprobs)) > 1e-3


@pytest.mark.parametrize("spec,expected", [("naive", 0), ("epic:k=4", 3 * 4), ("cacheblend:ratio=0.25", 16),
                                           ("cacheblend:ratio=0.25,weight=question,sink=0", 16),
                                           ("a3:ratio=0.5", 32), ("hypic:seam=4", 3 * 4),
                                           ("prophet:ratio=0.25,sink=0", 16), ("prophet:ratio=0.25", 16)])
def test_recompute_counts_follow_the_backend(engines, spec, expected):
    from tests.model_cases import CASES_BY_NAME

    llm = engines(CASES_BY_NAME["qwen3_gqa2_hd20"])
    pic = llm.generate({"segments": rag_prompt(seed=3, order=(1, 0, 2))}, GREEDY, pic_backend=spec)[0]
    assert pic.num_pic_cached_tokens == 64
    assert pic.num_recomputed_tokens == expected


@pytest.mark.parametrize("case", [c for c in MODEL_CASES if c.name == "mistral_gqa2"]
                         + [c for c in HYBRID_AND_MLA_CASES if c.family == "deepseek_v2"][:1], ids=str)
@pytest.mark.parametrize("spec", ["cacheblend:ratio=0.5,weight=question,sink=0", "prophet:ratio=0.5,sink=0"])
def test_question_attention_scores_gqa_and_mla_keys(engines, case, spec):
    """The question's attention is computed from GQA keys (repeated per head) and from MLA's decompressed keys."""
    llm = engines(case)
    pic = llm.generate({"segments": rag_prompt(seed=6, order=(2, 1, 0))}, GREEDY, pic_backend=spec)[0]
    assert pic.num_pic_cached_tokens == 64 and pic.num_recomputed_tokens == 32


def test_permuted_segments_hit_the_pic_store_where_prefix_caching_cannot(checkpoint_factory):
    from tests.model_cases import CASES_BY_NAME

    llm = LLM(str(checkpoint_factory(CASES_BY_NAME["mistral_gqa2"])), page_size=4, num_pages=512, pic_backend="epic")
    first = llm.generate({"segments": rag_prompt(seed=4)}, GREEDY)[0]
    assert first.num_pic_cached_tokens == 64  # cold segments are prefilled alone, then reused by the combine
    assert first.num_cached_tokens == 0  # ... but prefilled for this request: no cache hit
    permuted = rag_prompt(seed=4, order=(2, 1, 0))
    no_pic = llm.generate({"segments": permuted}, GREEDY, pic_backend=None)[0]
    assert no_pic.num_pic_cached_tokens == 0 and no_pic.num_prefix_cached_tokens == 8  # the system prompt's pages
    pic = llm.generate({"segments": rag_prompt(seed=4, order=(1, 2, 0))}, GREEDY)[0]
    assert pic.num_prefix_cached_tokens == 8 and pic.num_pic_cached_tokens == 64
    assert pic.num_cached_tokens == 72
    assert llm.llm_engine.model_runner.pic_executor.stats.segment_hits >= 3


def test_repeated_pic_prompt_is_a_prefix_cache_hit(checkpoint_factory):
    """The combined KV goes to the prefix cache too (prefix first, then PIC; paper §4.2)."""
    from tests.model_cases import CASES_BY_NAME

    llm = LLM(str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"])), page_size=4, num_pages=512)
    prompt = rag_prompt(seed=5)
    first = llm.generate({"segments": prompt}, GREEDY)[0]
    again = llm.generate({"segments": prompt}, GREEDY)[0]
    assert again.num_prefix_cached_tokens == 76 and again.num_pic_cached_tokens == 0  # every full page
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_text_prompts_with_tags_and_pic_off_give_the_same_token_ids(checkpoint_factory):
    from tests.model_cases import CASES_BY_NAME

    llm = LLM(str(checkpoint_factory(CASES_BY_NAME["mistral_gqa2"])), page_size=4, num_pages=256)
    text = "System: answer briefly.<pic>The first document talks about owls.</pic><pic>Second: cats.</pic> Q: owls?"
    on = llm.generate(text, GREEDY)[0]
    off = llm.generate(text, GREEDY, pic_backend=None)[0]
    assert on.prompt_token_ids == off.prompt_token_ids and on.prompt_token_ids[0] == 1  # BOS once
    assert on.num_pic_cached_tokens > 0 and off.num_pic_cached_tokens == 0
    chat = llm.chat([{"role": "user", "content": "Read <pic>doc about owls</pic> then answer."}], GREEDY)[0]
    assert chat.num_pic_cached_tokens > 0


def test_attention_only_backends_refuse_hybrid_models(checkpoint_factory):
    from tests.model_cases import CASES_BY_NAME

    path = str(checkpoint_factory(CASES_BY_NAME["qwen3_5_linear_full_linear"]))
    with pytest.raises(ValueError, match="linear-attention.*hypic"):
        LLM(path, num_pages=64, pic_backend="cacheblend")
    llm = LLM(path, num_pages=256, page_size=4)  # auto -> hypic
    assert llm.llm_engine.pic_backend.name == "hypic"
    with pytest.raises(ValueError, match="does not support"):
        llm.generate({"segments": rag_prompt(seed=6)}, GREEDY, pic_backend="epic")


def test_bad_backend_specs_are_clear_errors(engines):
    from tests.model_cases import CASES_BY_NAME

    llm = engines(CASES_BY_NAME["qwen3_gqa2_hd20"])
    for spec, message in [("blend", "unknown PIC backend"), ("epic:k=x", "needs a"), ("epic:z=1", "bad option"),
                          ("cacheblend:ratio=2", "ratio"), ("a3:check_layers=1/2", "one check layer")]:
        with pytest.raises(ValueError, match=message):
            llm.generate({"segments": rag_prompt(seed=7)}, GREEDY, pic_backend=spec)
    with pytest.raises(ValueError, match="check layer 9"):
        llm.generate({"segments": rag_prompt(seed=7)}, GREEDY, pic_backend="cacheblend:check_layers=9")
    assert not llm.llm_engine.has_unfinished_requests()


def test_segment_keys_name_the_entries_the_backend_stores(checkpoint_factory):
    """The router and the workers key segments through LLMEngine.segment_key: it must name what the engine stores."""
    from nebula_engine.engine.admission import ENGINE_DEFAULT
    from tests.model_cases import CASES_BY_NAME

    hybrid = LLM(str(checkpoint_factory(CASES_BY_NAME["qwen3_5_linear_full_linear"])), page_size=4, num_pages=256)
    engine, ids = hybrid.llm_engine, list(range(100, 130))
    executor = engine.model_runner.pic_executor
    assert engine.segment_key(ENGINE_DEFAULT, ids) == executor.segment_key(engine.pic_backend, ids)  # hypic
    assert engine.segment_key("hypic:seam=4", ids) != engine.segment_key(ENGINE_DEFAULT, ids)
    assert engine.segment_key(None, ids) == ""
    hybrid.generate({"segments": [("regular", [7, 8]), ("pic", ids), ("regular", [9, 10])]}, GREEDY)
    assert engine.segment_key(ENGINE_DEFAULT, ids) in engine.cache_store.pic

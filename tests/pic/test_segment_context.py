"""Segments prefilled behind the request's prefix (``context=prefix``), and CacheBlend's and A3's selection options:
exact settings still equal plain prefill, a document cached behind the same prefix at the same place is exact
with no recompute, store keys follow the prefix, and bad options are clear errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nebula_engine import LLM
from nebula_engine.pic.backends import get_pic_backend
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)
from tests.pic.test_backends_exact import GREEDY, flat, rag_prompt

EXACT_WITH_LEVERS = ("full:context=prefix", "epic:k=100000,context=prefix", "cacheblend:ratio=1.0,context=prefix",
                     "a3:ratio=1.0,context=prefix,softmax=context", "cacheblend:ratio=1.0,sink=2")
CASES = ("mistral_gqa2", "qwen3_gqa2_hd20")  # with a BOS, without one


@pytest.fixture(scope="module")
def engines(checkpoint_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = LLM(str(checkpoint_factory(CASES_BY_NAME[name])), page_size=4, num_pages=512,
                              enable_prefix_caching=False)
        return cache[name]
    return get


def logprobs(output) -> list[float]:
    return output.outputs[0].token_logprobs


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("spec", EXACT_WITH_LEVERS)
def test_exact_settings_with_levers_equal_plain_prefill(engines, name, spec):
    llm = engines(name)
    target = rag_prompt(seed=11, order=(2, 0, 1))
    plain = llm.generate({"prompt_token_ids": flat(target)}, GREEDY, pic_backend=None)[0]
    llm.generate({"segments": rag_prompt(seed=11)}, GREEDY, pic_backend=spec)  # caches the segments elsewhere
    pic = llm.generate({"segments": target}, GREEDY, pic_backend=spec)[0]
    assert pic.num_pic_cached_tokens == 64 and pic.num_recomputed_tokens == 64
    assert pic.outputs[0].token_ids == plain.outputs[0].token_ids
    assert logprobs(pic) == pytest.approx(logprobs(plain), abs=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_a_document_cached_behind_the_same_prefix_at_the_same_place_is_exact_without_recompute(engines, name):
    """The first document right after the prefix: its K/V made behind that prefix is what plain prefill makes, so
    ``naive`` with context=prefix equals plain prefill; made alone (or behind a BOS only) it does not."""
    llm = engines(name)
    system, doc = [5 + i for i in range(100, 109)], list(range(300, 330))
    warm = [("regular", system), ("pic", doc), ("regular", [7, 8, 9])]
    target = [("regular", system), ("pic", doc), ("regular", [11, 12, 13, 14])]
    plain = llm.generate({"prompt_token_ids": flat(target)}, GREEDY, pic_backend=None)[0]
    for spec, exact in (("naive:context=prefix", True), ("naive", False)):
        llm.generate({"segments": warm}, GREEDY, pic_backend=spec)
        pic = llm.generate({"segments": target}, GREEDY, pic_backend=spec)[0]
        assert pic.num_pic_cached_tokens == 30 and pic.num_recomputed_tokens == 0
        error = max(abs(a - b) for a, b in zip(logprobs(pic), logprobs(plain)))
        assert (error < 1e-4) == exact, (spec, error)


def test_segment_keys_follow_the_prefix_and_another_prefix_prefills_its_own(engines):
    llm = engines("qwen3_gqa2_hd20")
    executor = llm.llm_engine.model_runner.pic_executor
    doc = list(range(400, 420))
    prefixed, alone = get_pic_backend("epic:context=prefix"), get_pic_backend("epic")
    assert executor.segment_key(prefixed, doc, (1, 2)) != executor.segment_key(prefixed, doc, (1, 3))
    assert executor.segment_key(prefixed, doc, (1, 2)) != executor.segment_key(alone, doc)
    assert executor.segment_key(alone, doc, (1, 2)) == executor.segment_key(alone, doc, (1, 3))

    def run(spec, system):
        before = executor.stats.segment_misses
        llm.generate({"segments": [("regular", system), ("pic", doc), ("regular", [9, 9])]}, GREEDY,
                     pic_backend=spec)
        return executor.stats.segment_misses - before

    assert (run("epic:context=prefix", [101, 102, 103]), run("epic:context=prefix", [101, 102, 103])) == (1, 0)
    assert run("epic:context=prefix", [104, 105]) == 1  # another prefix: not the first one's K/V
    assert (run("epic", [101, 102, 103]), run("epic", [104, 105])) == (1, 0)  # alone: one entry for both
    assert executor.segment_key(prefixed, doc, (104, 105)) in llm.llm_engine.cache_store.pic


@pytest.mark.parametrize("spec,expected", [("cacheblend:ratio=0.25,sink=2", 16), ("a3:ratio=0.5,sink=1", 32),
                                           ("a3:ratio=0.5,softmax=context", 32), ("epic:k=4,context=prefix", 12)])
def test_levers_keep_the_recompute_budget(engines, spec, expected):
    llm = engines("qwen3_gqa2_hd20")
    pic = llm.generate({"segments": rag_prompt(seed=13, order=(1, 0, 2))}, GREEDY, pic_backend=spec)[0]
    assert pic.num_pic_cached_tokens == 64 and pic.num_recomputed_tokens == expected


def test_sink_heads_are_always_recomputed():
    """With a budget of exactly the heads, cacheblend:sink keeps the heads whatever the deviation scores say."""
    from nebula_engine.pic.backends.cacheblend import CacheBlend
    from nebula_engine.pic.layout import CombineLayout

    layout = CombineLayout.plan(40, 0, [(4, 10), (14, 10), (24, 10)], [True, True, True])
    backend = CacheBlend(ratio=0.2, sink=2)  # floor(0.2 * 30) = 6 = 3 segments x 2 heads

    run = SimpleNamespace(layout=layout)
    rows = torch.arange(0, 40)
    scores = torch.arange(30, dtype=torch.float32)  # the tail tokens score highest
    kept = rows[backend.keep(run, rows, scores, 0.2)].tolist()
    assert [p for p in kept if p in layout.reused_position_set] == [4, 5, 14, 15, 24, 25]


def test_specs_round_trip_and_bad_options_are_clear_errors(checkpoint_factory):
    assert get_pic_backend("epic").spec == "epic:k=16"  # the default context is not spelled out
    assert get_pic_backend("epic:k=4,context=prefix").spec == "epic:context=prefix,k=4"
    assert get_pic_backend(get_pic_backend("a3:softmax=context,sink=1").spec).softmax == "context"
    for spec, message in [("epic:context=request", "context must be one of alone, prefix"),
                          ("cacheblend:sink=-1", "sink must be a non-negative"),
                          ("a3:softmax=all", "softmax must be 'reused' or 'context'")]:
        with pytest.raises(ValueError, match=message):
            get_pic_backend(spec)
    with pytest.raises(ValueError, match="context=prefix is for attention-only"):
        LLM(str(checkpoint_factory(CASES_BY_NAME["qwen3_5_linear_full_linear"])), num_pages=64,
            pic_backend="hypic:context=prefix")


def test_offline_prefill_caches_documents_behind_the_prefix_serving_finds(checkpoint_factory, tmp_path):
    from tests.engine.test_offline_prefill import DOCUMENTS, ENGINE, rag_prompt, run_prefill, write_corpus

    model, disk, spec = str(checkpoint_factory(CASES_BY_NAME["mistral_gqa2"])), tmp_path / "disk", "epic:context=prefix"
    lines = [{"id": f"doc{i}", "text": d, "prefix": "Use these notes.\n"} for i, d in enumerate(DOCUMENTS)]
    lines += [{"text": "no prefix named"}, {"text": "two", "prefix": "a", "system": "b"},
              {"text": "tag", "prefix": "a <pic>"}]
    report = run_prefill(model, disk, write_corpus(tmp_path / "docs.jsonl", lines), spec)
    assert (report.prefilled, report.failed) == (5, 3)
    reasons = [failure.reason for failure in report.failures]
    assert "give the line one of system, prefix, prefix_token_ids" in reasons[0]
    assert "at most one prefix" in reasons[1] and "<pic>" in reasons[2]

    served = LLM(model, pic_backend=spec, disk_cache_tokens=100_000, disk_cache_path=str(disk), **ENGINE)
    served.generate(rag_prompt((3, 0, 4, 1, 2)), GREEDY)
    stats = served.llm_engine.model_runner.pic_executor.stats
    assert (stats.segment_misses, stats.segment_hits) == (0, 5)  # every document came from disk
    served.generate("Other notes.\n<pic>" + DOCUMENTS[0] + "</pic>\nQuestion: owls?", GREEDY)
    assert stats.segment_misses == 1  # behind another prefix: prefilled anew, not the disk's entry
    served.llm_engine.cache_store.close()

    alone = write_corpus(tmp_path / "alone.jsonl", [{"text": DOCUMENTS[0], "prefix": "Use these notes.\n"}])
    failed = run_prefill(model, tmp_path / "disk2", alone, "epic")
    assert failed.failed == 1 and "only for a PIC backend with context=prefix" in failed.failures[0].reason

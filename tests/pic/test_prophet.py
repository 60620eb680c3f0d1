"""The ``prophet`` backend's two stages: the scout is the naive forward and scores the question's attention mass;
the combine recomputes the fresh rows, each document's sink heads and the top-scored reused tokens."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nebula_engine.model.tiny import make_tiny_checkpoint
from nebula_engine.pic.backends import get_pic_backend
from nebula_engine.pic.backends.baselines import NaiveReuse
from nebula_engine.pic.backends.prophet import Prophet, question_attention_scores
from nebula_engine.pic.layout import CombineLayout

TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if str(TOOLS_DIR) not in sys.path:
        sys.path.insert(0, str(TOOLS_DIR))
    import pic_quality

    path = make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("prophet"), seed=3)
    harness = pic_quality.PICHarness(str(path), num_pages=256, page_size=8)
    shape = pic_quality.PromptShape(system_len=6, num_docs=3, doc_len=20, question_len=5)
    prompt = pic_quality.RagPrompt.random(shape, harness.vocab_range(), seed=1)
    harness.warm(NaiveReuse(), prompt)
    return SimpleNamespace(harness=harness, segmented=harness.segmented(prompt))


def fresh_kv(h, run) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = torch.tensor(run.layout.fresh_positions)
    n = run.layout.num_tokens
    return [tuple(t[rows] for t in h.read_kv(i, run.block_table, n)) for i in range(len(h.attention_layer_indices()))]


def test_the_scout_is_the_naive_forward_and_scores_attention_mass(harness):
    h, segmented = harness.harness, harness.segmented
    n = len(segmented.token_ids)
    tables = [h.allocate(n), h.allocate(n)]
    try:
        scouted = h.combine_run(Prophet(), segmented, tables[0])
        scores, = question_attention_scores([scouted])
        naive = h.combine_run(NaiveReuse(), segmented, tables[1])
        NaiveReuse().combine(naive)
        for (k, v), (k_ref, v_ref) in zip(fresh_kv(h, scouted), fresh_kv(h, naive)):
            torch.testing.assert_close(k, k_ref)
            torch.testing.assert_close(v, v_ref)
        layout = scouted.layout
        num_heads = h.model.attention_layers()[0].num_heads
        num_question = layout.num_tokens - layout.question_start
        num_layers = len(h.attention_layer_indices())
        # every query's softmax sums to 1: the mass is layers x heads x question tokens, all of it on keys it sees
        assert float(scores.sum()) == pytest.approx(num_layers * num_heads * num_question, rel=1e-5)
        assert bool((scores[torch.tensor(layout.reused_positions)] > 0).all())
        last_layer, = question_attention_scores([scouted], first_layer=num_layers - 1)
        assert float(last_layer.sum()) == pytest.approx(num_heads * num_question, rel=1e-5)
        last_token, = question_attention_scores([scouted], last_only=True)
        assert float(last_token.sum()) == pytest.approx(num_layers * num_heads, rel=1e-5)
    finally:
        for table in tables:
            h.release(table)


def test_rows_are_the_fresh_ones_the_sink_heads_and_the_top_scored():
    layout = CombineLayout.plan(40, 0, [(4, 10), (14, 10), (24, 10)], [True, True, True])
    run = SimpleNamespace(layout=layout, positions=lambda p: torch.tensor(list(p), dtype=torch.int64))
    scores = torch.zeros(40)
    scores[[30, 31, 9, 2]] = torch.tensor([3.0, 2.0, 1.0, 9.0])  # 2 is fresh: it is kept anyway, scored or not
    rows = Prophet(ratio=0.3, sink=2).rows(run, scores)  # 9 of 30 reused: 6 sink heads + the top 3
    assert [p for p in rows if p in layout.reused_position_set] == [4, 5, 9, 14, 15, 24, 25, 30, 31]
    assert [p for p in rows if p not in layout.reused_position_set] == [0, 1, 2, 3, 34, 35, 36, 37, 38, 39]
    assert Prophet(ratio=0.1, sink=0).rows(run, scores) == [0, 1, 2, 3, 9, 30, 31, 34, 35, 36, 37, 38, 39]
    one = torch.zeros(40)
    one[20] = 5.0  # smoothed, its neighbours share its score and outrank every other token
    assert Prophet(ratio=0.1, sink=0, pool_kernel=3).rows(run, one)[4:7] == [19, 20, 21]


def test_bad_options_are_clear_errors(harness):
    for spec, message in [("prophet:ratio=1.5", "ratio must be in"), ("prophet:sink=-1", "sink must be"),
                          ("prophet:queries=all", "queries must be one of question, last"),
                          ("prophet:first_layer=-2", "first_layer must be"),
                          ("prophet:pool_kernel=4", "pool_kernel must be a positive odd integer")]:
        with pytest.raises(ValueError, match=message):
            get_pic_backend(spec)
    with pytest.raises(ValueError, match="first_layer 99 but the model has"):
        get_pic_backend("prophet:first_layer=99").check_model(harness.harness.model)


def test_scores_computed_a_few_queries_at_a_time_are_the_same(harness, monkeypatch):
    from nebula_engine.pic.backends import prophet

    h, segmented = harness.harness, harness.segmented
    table = h.allocate(len(segmented.token_ids))
    try:
        run = h.combine_run(Prophet(), segmented, table)
        whole, = question_attention_scores([run])
        monkeypatch.setattr(prophet, "SCORE_CHUNK_ELEMENTS", 1)  # one question token per chunk
        chunked, = question_attention_scores([run])
    finally:
        h.release(table)
    torch.testing.assert_close(chunked, whole)

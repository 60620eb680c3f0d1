"""tools/pic_quality.py and tools/bench_pic.py on tiny settings: output structure and the truths that must hold
(full prefill through the combine equals plain prefill; naive recomputes nothing; recompute counts follow the
backend's definition), not the timings."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"
TINY = ["--hidden-size", "64", "--num-heads", "8", "--num-kv-heads", "2", "--page-size", "8", "--threads", "1"]


@pytest.fixture(autouse=True, scope="module")
def keep_torch_threads():
    """The tools set torch's thread count for the process: put it back for the tests that follow."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def import_tool(name: str):
    if str(TOOLS_DIR) not in sys.path:
        sys.path.insert(0, str(TOOLS_DIR))  # bench_pic imports its harness from the sibling pic_quality
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def quality(tmp_path_factory):
    """One run of pic_quality: tiny mistral with the five attention backends, tiny qwen3_5 with hypic."""
    out = tmp_path_factory.mktemp("pic_quality") / "quality.json"
    report = import_tool("pic_quality").main(
        TINY + ["--layers", "4", "--system-len", "8", "--num-docs", "2", "--doc-len", "24", "--question-len", "6",
                "--num-prompts", "2", "--steps", "3", "--out", str(out)])
    return report, json.loads(out.read_text())


def by_backend(run: dict) -> dict[str, dict]:
    return {result["backend"]: result for result in run["results"]}


def test_quality_report_structure_and_json(quality, capsys):
    report, written = quality
    assert written == json.loads(json.dumps(report))
    assert report["caveat"] and "attention sinks" in report["caveat"]
    assert [run["model"]["family"] for run in report["runs"]] == ["mistral", "qwen3_5"]
    mistral, hybrid = report["runs"]
    assert list(by_backend(mistral)) == ["full", "naive", "epic", "cacheblend", "a3", "prophet"]
    assert list(by_backend(hybrid)) == ["hypic:seam=1000000", "hypic"]
    assert mistral["prompt"]["num_tokens"] == 1 + 8 + 2 * 24 + 6  # Mistral's BOS opens the prompt
    for run in report["runs"]:
        for result in run["results"]:
            assert len(result["per_prompt"]) == 2 and all(p["steps"] == 3 for p in result["per_prompt"])
    # attention layers get K/V deviations, Qwen3.5's linear layers (0, 1, 2) the state deviation instead
    assert [r["layer"] for r in by_backend(mistral)["naive"]["kv_deviation"]] == [0, 1, 2, 3]
    assert [r["layer"] for r in by_backend(hybrid)["hypic"]["kv_deviation"]] == [3]
    assert [r["layer"] for r in by_backend(hybrid)["hypic"]["state_deviation"]] == [0, 1, 2]


def test_full_prefill_through_the_combine_equals_plain_prefill(quality):
    report, _ = quality
    mistral, hybrid = report["runs"]
    for exact in (by_backend(mistral)["full"], by_backend(hybrid)["hypic:seam=1000000"]):
        assert exact["kl_next"] < 1e-9 and exact["kl_continuation_mean"] < 1e-9
        assert exact["top1_agreement"] == 1.0
        assert exact["num_recomputed"] == exact["num_reused"] == 2 * 24
        assert max(exact["key_deviation_mean"], exact["value_deviation_mean"]) < 1e-5
        assert all(r["state"] < 1e-5 for r in exact["state_deviation"])


def test_reuse_counts_and_deviations_follow_the_backend(quality):
    report, _ = quality
    results = by_backend(report["runs"][0])
    naive = results["naive"]
    assert naive["num_recomputed"] == 0 and naive["kl_next"] > 1e-6  # reused K/V is not what full prefill computes
    # layer 0's K/V depend only on the token and its position: re-rotation makes them exact; later layers differ
    assert naive["kv_deviation"][0]["key"] < 1e-5 and naive["kv_deviation"][0]["value"] < 1e-5
    assert naive["kv_deviation"][-1]["value"] > 1e-3
    assert results["epic"]["num_recomputed"] == 2 * 16  # the first k=16 tokens of each document
    assert results["cacheblend"]["num_recomputed"] == results["a3"]["num_recomputed"] == 7  # floor(0.15 * 48)
    assert results["prophet"]["num_recomputed"] == 9  # floor(0.2 * 48)
    assert naive["cost_fraction"] < results["epic"]["cost_fraction"] < results["full"]["cost_fraction"] == 1.0
    assert by_backend(report["runs"][1])["hypic"]["num_recomputed"] == 2 * 16  # the seam of each document


def test_quality_prints_one_table_and_the_caveat(tmp_path, capsys):
    import_tool("pic_quality").main(TINY + ["--layers", "2", "--system-len", "4", "--num-docs", "2", "--doc-len", "8",
                                            "--question-len", "4", "--num-prompts", "1", "--steps", "2",
                                            "--hybrid-family", "none", "--backend", "naive",
                                            "--backend", "epic:k=2"])
    printed = capsys.readouterr().out
    assert "KL next" in printed and "attention sinks" in printed
    rows = [line for line in printed.splitlines() if line.startswith("mistral ")]
    assert [row.split()[1] for row in rows] == ["naive", "epic:k=2"]


def test_quality_rejects_bad_settings():
    tool = import_tool("pic_quality")
    with pytest.raises(ValueError, match="multiple of 4"):
        tool.main(TINY + ["--family", "qwen3_5", "--layers", "3"])
    with pytest.raises(SystemExit):
        tool.main(["--steps", "0"])
    with pytest.raises(ValueError, match="does not support"):
        tool.main(TINY + ["--family", "qwen3_5", "--layers", "4", "--num-docs", "1", "--doc-len", "4",
                          "--num-prompts", "1", "--steps", "1", "--backend", "epic"])


BENCH_TINY = TINY + ["--num-segments", "2", "--segment-len", "32", "--query-len", "8", "--repeats", "1"]


def test_bench_times_every_backend_against_full_prefill(tmp_path):
    out = tmp_path / "bench.json"
    result = import_tool("bench_pic").main(BENCH_TINY + ["--layers", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = {row["backend"]: row for row in result["results"]}
    assert list(rows) == ["plain prefill", "full", "naive", "epic:k=16", "cacheblend:ratio=0.15", "a3:ratio=0.15",
                          "prophet:ratio=0.2"]
    assert result["num_tokens"] == 1 + 2 * 32 + 8 and result["baseline"] == "full" and result["threads"] == 1
    assert all(row["ms"] > 0 for row in rows.values()) and result["place_ms"] > 0
    assert rows["full"]["speedup_vs_full"] == 1.0 and rows["plain prefill"]["speedup_vs_plain"] == 1.0
    assert [rows[name]["num_recomputed"] for name in list(rows)[1:]] == [64, 0, 32, 9, 9, 12]
    assert isinstance(rows["epic:k=16"]["goal_met"], bool) and rows["epic:k=16"]["goal"] == 5.0
    assert rows["cacheblend:ratio=0.15"]["goal"] == 2.0 and rows["naive"]["goal"] is None


def test_bench_hybrid_family_runs_hypic_against_plain_prefill():
    result = import_tool("bench_pic").main(BENCH_TINY + ["--family", "qwen3_5", "--layers", "4"])
    rows = {row["backend"]: row for row in result["results"]}
    assert list(rows) == ["plain prefill", "hypic"] and result["baseline"] == "plain prefill"
    assert rows["hypic"]["num_recomputed"] == 2 * 16 and rows["hypic"]["speedup_vs_full"] is None


def test_quality_runs_a_local_checkpoint_given_with_model(tmp_path):
    from nebula_engine.model.tiny import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint("qwen3", tmp_path / "ckpt", seed=3)
    report = import_tool("pic_quality").main(["--model", str(checkpoint), "--prompts", "random",
                                              "--system-len", "4", "--num-docs", "2",
                                              "--doc-len", "8", "--question-len", "4", "--num-prompts", "1",
                                              "--steps", "2", "--backend", "full", "--threads", "1"])
    assert report["caveat"] is None  # real weights are the user's claim; the tiny-model caveat is not printed
    (run,) = report["runs"]
    assert run["model"]["family"] == "qwen3" and run["prompt"]["num_tokens"] == 4 + 2 * 8 + 4  # Qwen: no BOS
    assert run["results"][0]["top1_agreement"] == 1.0


def test_sweep_adds_each_named_backends_settings_once():
    rag = import_tool("pic_quality_rag")
    specs = rag.with_sweep(["naive", "epic", "cacheblend:context=prefix", "epic:k=4"])
    assert specs[:5] == ["naive", "epic", "epic:k=2", "epic:k=4", "epic:k=8"]
    assert "cacheblend:ratio=0.05" in specs and len(specs) == len(set(specs))
    assert rag.sweep_line("cacheblend:ratio=0.3,context=prefix") == "cacheblend:context=prefix"
    assert rag.sweep_line("epic:k=4") == "epic"


def test_merge_pools_the_rows_of_runs_over_disjoint_prompts(tmp_path, capsys, monkeypatch):
    rag = import_tool("pic_quality_rag")
    keys = ("recomputed", "reused_share", "kl_next", "top1_next", "kl_tf", "top1_tf", "match20", "correct",
            "combine_share")

    def part(path, kl, correct):
        row = {**dict.fromkeys(keys, 0.5), "kl_next": kl, "correct": correct, "reply": "r"}
        path.write_text(json.dumps({"model": "m", "segment_sink": None, "rows": {"naive": [row]},
                                    "command": f"python tools/pic_quality.py --out {path.name}",
                                    "pic_off": [{"correct": correct, "reply": "r", "answer": "a", "num_tokens": 10}]}))
        return str(path)

    report = rag.merge([part(tmp_path / "a.json", 0.1, 1.0), part(tmp_path / "b.json", 0.3, 0.0)],
                       str(tmp_path / "t.md"), None)
    assert report["num_prompts"] == 2 and report["pic_off_accuracy"] == 0.5
    assert report["results"][0]["kl_next"] == pytest.approx(0.2)
    assert "| naive | 50% | 0.200 |" in (tmp_path / "t.md").read_text()
    monkeypatch.chdir(tmp_path)  # the results page goes to docs/results/ under the working directory
    rag.merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")], None, None, docs_page="pic-quality",
              notes=("a3 left out",))
    page = (tmp_path / "docs" / "results" / "pic-quality.md").read_text()
    assert page.startswith("# PIC quality on a real model\n") and "| naive | 50% | 0.200 |" in page
    assert "PIC off answers 50% correctly (1/2)" in page and "Written by `" in page and "- CPU: " in page
    assert "Measured by `python tools/pic_quality.py --out a.json`." in page and "- a3 left out" in page
    assert (tmp_path / "docs" / "results" / "pic-quality.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="same backend specs"):
        bad = tmp_path / "c.json"
        bad.write_text(json.dumps({"rows": {"epic": []}, "pic_off": []}))
        rag.merge([str(tmp_path / "a.json"), str(bad)], None, None)


def test_merge_sets_runs_of_other_backends_over_the_same_prompts_side_by_side(tmp_path):
    rag = import_tool("pic_quality_rag")
    keys = ("recomputed", "reused_share", "kl_next", "top1_next", "kl_tf", "top1_tf", "match20", "correct",
            "combine_share")
    off = [{"correct": 1.0, "reply": "r", "answer": "a", "num_tokens": 10},
           {"correct": 0.0, "reply": "s", "answer": "b", "num_tokens": 12}]

    def part(path, spec, kl, prompts=off):
        rows = [{**dict.fromkeys(keys, 0.5), "kl_next": kl, "reply": "r"} for _ in prompts]
        path.write_text(json.dumps({"model": "m", "segment_sink": None, "rows": {spec: rows}, "pic_off": prompts}))
        return str(path)

    report = rag.merge([part(tmp_path / "a.json", "naive", 0.4), part(tmp_path / "b.json", "epic", 0.1)], None, None)
    assert report["num_prompts"] == 2 and report["pic_off_accuracy"] == 0.5
    assert {r["backend"]: r["kl_next"] for r in report["results"]} == pytest.approx({"naive": 0.4, "epic": 0.1})
    with pytest.raises(SystemExit, match="disjoint specs over the same prompts"):  # other prompts: not comparable
        rag.merge([str(tmp_path / "a.json"), part(tmp_path / "c.json", "epic", 0.1, off[:1])], None, None)


def test_oracle_scores_are_errors_relative_to_the_full_prefill_and_follow_the_question_attention():
    oracle = import_tool("pic_oracle")
    ref = [torch.ones(3, 1, 2), torch.ones(3, 1, 2)]  # squared norm 2 per token
    shift = torch.tensor([0.0, 3.0, 1.0])[:, None, None] * torch.tensor([1.0, 0.0])
    placed = [ref[0].clone(), ref[1] + shift]  # layer 0 exact (as after re-rotation), layer 1 off by 0, 3, 1
    reused = torch.tensor([True, True, True])
    deviation = oracle.deviation_scores(placed, placed, ref, ref, reused)
    assert deviation.tolist() == pytest.approx([0.0, 9.0, 1.0])  # (9 and 1) / 2, for K and for V; layer 0 adds 0
    # a row the combine computes anyway holds stale K/V: it neither scores nor changes the reused rows' scale
    stale = [torch.cat([p, torch.full((1, 1, 2), 1e6)]) for p in placed]
    padded = [torch.cat([r, torch.full((1, 1, 2), 1e3)]) for r in ref]
    with_stale = oracle.deviation_scores(stale, stale, padded, padded, torch.tensor([True, True, True, False]))
    assert with_stale.tolist() == pytest.approx([0.0, 9.0, 1.0, 0.0])
    # one head, one question row: tokens 1 and 2 have the same V error, only token 1 draws attention
    attention = [torch.tensor([[[0.0, 1.0, 0.0]]])] * 2
    values = [torch.tensor([[[1.0]], [[2.0]], [[2.0]]])] * 2
    impact = oracle.impact_scores(values, [torch.ones(3, 1, 1)] * 2, attention, reused)
    assert impact.tolist() == pytest.approx([0.0, 2.0, 0.0])  # error 1 over V norm 1, in each of two layers


def test_ranked_blend_recomputes_the_top_scored_tokens_and_each_documents_sink():
    from types import SimpleNamespace

    from nebula_engine.pic.layout import CombineLayout

    oracle = import_tool("pic_oracle")
    layout = CombineLayout.plan(40, 0, [(4, 10), (14, 10), (24, 10)], [True, True, True])
    scores = torch.zeros(40)
    scores[[30, 31, 9]] = torch.tensor([3.0, 2.0, 1.0])
    backend = oracle.RankedBlend(ratio=0.3, sink=2, scores=scores)  # 9 of 30: 6 sink heads + the top 3
    rows = torch.arange(40)
    kept = rows[backend.select(1, SimpleNamespace(layout=layout), rows, None, {})].tolist()
    assert [p for p in kept if p in layout.reused_position_set] == [4, 5, 9, 14, 15, 24, 25, 30, 31]
    assert [p for p in kept if p not in layout.reused_position_set] == [0, 1, 2, 3, 34, 35, 36, 37, 38, 39]


def test_oracle_on_smollm2_is_exact_at_full_recompute_and_keeps_cacheblends_budget(smollm2_path, tmp_path):
    pytest.importorskip("gguf", reason="SmolLM2 is a GGUF file: pip install 'nebula-engine[gguf]'")
    oracle = import_tool("pic_oracle")
    report = oracle.main(["--model", str(smollm2_path), "--num-prompts", "1", "--ratio", "0.2", "--ratio", "1.0",
                          "--through-layer", "1", "--threads", "1",
                          "--out", str(tmp_path / "o.json")])
    rows = {r["backend"]: r for r in report["results"]}
    oracles = [f"{name}:ratio={{}},layers=0-1" for name in oracle.ORACLES]
    assert list(rows) == [spec.format(ratio) for ratio in (0.2, 1.0) for spec in ["cacheblend:ratio={}", *oracles]]
    for spec in ["cacheblend:ratio={}", *oracles]:
        exact = rows[spec.format(1.0)]
        assert exact["recomputed"] == 1.0 and exact["kl_next"] < 1e-9 and exact["top1_tf"] == 1.0
        assert rows[spec.format(0.2)]["recomputed"] == rows["cacheblend:ratio=0.2"]["recomputed"]
    assert 0.15 < rows["cacheblend:ratio=0.2"]["recomputed"] <= 0.2
    assert json.loads((tmp_path / "o.json").read_text())["num_prompts"] == 1
    with pytest.raises(SystemExit, match="30 attention layers"):
        oracle.main(["--model", str(smollm2_path), "--through-layer", "30"])
    with pytest.raises(SystemExit):
        oracle.main(["--ratio", "0"])


def test_summary_reads_the_quality_pages_and_checks_the_goal(tmp_path):
    rag, summary = import_tool("pic_quality_rag"), import_tool("pic_quality_summary")
    from nebula_engine.bench.results_page import write_page

    def page(name, model, kl, top1_tf, correct):
        row = {"backend": "cacheblend", "recomputed": 0.15, "reused_share": 0.9, "kl_next": kl, "top1_next": 0.9,
               "kl_tf": 0.1, "top1_tf": top1_tf, "match20": 0.5, "correct": correct, "combine_share": 0.3}
        off = [{"correct": 1.0, "num_tokens": 100}] * 3 + [{"correct": 0.0, "num_tokens": 100}]
        report = {"model": model, "segment_sink": None, "num_prompts": 4, "mean_tokens": 100.0,
                  "reused_share": 0.9, "pic_off_accuracy": 0.75, "pic_off": off, "results": [row]}
        write_page(rag.quality_page(report, name, None), tmp_path)

    page("small", "tiny-a", 0.5, 0.9, 0.25)
    page("large", "tiny-b", 0.02, 0.98, 0.5)
    text = summary.write_summary(["small", "large"], out_dir=tmp_path).read_text()
    assert "| tiny-a ([small](small.md)) | 4 | 100 | cacheblend | 15% | 0.500 | 0.90 | 0.90 | 1/4 (off 3) | " \
           "misses KL, top-1, accuracy |" in text
    assert "| tiny-b ([large](large.md)) | 4 | 100 | cacheblend | 15% | 0.020 | 0.90 | 0.98 | 2/4 (off 3) | met |" \
        in text
    assert text.index("tiny-a") < text.index("tiny-b")  # the order given: smallest model first
    with pytest.raises(SystemExit, match="no results page"):
        summary.write_summary(["missing"], out_dir=tmp_path)

"""Offline prefill: a corpus prefilled to a disk tier serves a fresh engine's first request with no scatter
prefill and the same greedy output; reruns skip what is on disk; bad lines are counted with their line numbers."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from nebula_engine import LLM, SamplingParams
from nebula_engine.config import EngineConfig
from nebula_engine.engine.async_engine import AsyncLLMEngine
from nebula_engine.engine.offline_prefill import MANIFEST_FILE, OfflinePrefill, build_prefill_engine
from nebula_engine.engine.request_port import ENGINE_DEFAULT
from nebula_engine.cli.prefill import prefill
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
ENGINE = dict(page_size=4, num_pages=128)
DOCUMENTS = (
    "Owls hunt at night and can turn their heads almost all the way around.",
    "The Rhine flows from the Swiss Alps to the North Sea through six countries.",
    "Paged attention stores keys and values in fixed-size pages.",
    "A haiku has three lines of five, seven and five syllables.",
    "Copper conducts heat well, which is why pans are often made of it.",
)


def write_corpus(path, lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def run_prefill(model: str, disk, corpus: str, pic_backend: str = "epic", batch_size: int = 2, **options):
    runner = OfflinePrefill(build_prefill_engine(model, disk, pic_backend, **ENGINE, **options), batch_size)
    try:
        return runner.run(corpus)
    finally:
        runner.close()


def rag_prompt(order) -> str:
    return "Use these notes.\n" + "".join(f"<pic>{DOCUMENTS[i]}</pic>" for i in order) + "\nQuestion: owls?"


@pytest.fixture
def corpus(tmp_path) -> str:
    return write_corpus(tmp_path / "docs.jsonl", [{"id": f"doc{i}", "text": d} for i, d in enumerate(DOCUMENTS)])


@pytest.mark.parametrize("case_name,backend", [("mistral_gqa2", "epic"), ("qwen3_5_linear_full_linear", "hypic")])
def test_fresh_engine_serves_prefilled_documents_from_disk_like_one_that_prefilled_them(
        checkpoint_factory, tmp_path, corpus, case_name, backend):
    model = str(checkpoint_factory(CASES_BY_NAME[case_name]))
    disk = tmp_path / "disk"
    report = run_prefill(model, disk, corpus, backend)
    assert (report.prefilled, report.skipped, report.failed) == (5, 0, 0)
    manifest = json.loads((disk / MANIFEST_FILE).read_text())
    assert manifest["page_size"] == 4 and manifest["last_run"]["prefilled"] == 5

    order = (3, 0, 4, 1, 2)
    served = LLM(model, pic_backend=backend, disk_cache_tokens=100_000, disk_cache_path=str(disk), **ENGINE)
    warm = served.generate(rag_prompt(order), GREEDY)[0]
    stats = served.llm_engine.model_runner.pic_executor.stats
    assert warm.num_pic_cached_tokens > 0
    assert (stats.segment_misses, stats.segment_skipped, stats.segment_hits) == (0, 0, 5)  # all came from disk

    cold_engine = LLM(model, pic_backend=backend, **ENGINE)
    cold = cold_engine.generate(rag_prompt(order), GREEDY)[0]
    assert cold_engine.llm_engine.model_runner.pic_executor.stats.segment_misses == 5
    assert warm.prompt_token_ids == cold.prompt_token_ids
    assert warm.num_pic_cached_tokens == cold.num_pic_cached_tokens
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    served.llm_engine.cache_store.close()


def test_rerun_skips_every_document_already_on_disk_and_resumes_the_rest(checkpoint_factory, tmp_path, corpus):
    model = str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"]))
    disk = tmp_path / "disk"
    first_three = write_corpus(tmp_path / "head.jsonl", [{"text": d} for d in DOCUMENTS[:3]])
    assert run_prefill(model, disk, first_three).prefilled == 3  # a run stopped after three documents
    resumed = run_prefill(model, disk, corpus)
    assert (resumed.prefilled, resumed.skipped, resumed.failed) == (2, 3, 0)
    again = run_prefill(model, disk, corpus)
    assert (again.prefilled, again.skipped, again.failed) == (0, 5, 0)
    other_backend = run_prefill(model, disk, corpus, pic_backend="cacheblend")
    assert other_backend.prefilled == 0  # cacheblend computes segments as epic does: same cache format, same keys
    engine = build_prefill_engine(model, disk, "epic", page_size=8, num_pages=64)
    with pytest.raises(ValueError, match="pages of 4 tokens"):
        OfflinePrefill(engine)  # shuts down the engine it was given
    assert not engine.stats().alive


@pytest.mark.parametrize("options, message", [
    (dict(pic_backend=None, disk_cache_tokens=1000), "needs a PIC backend"),
    (dict(pic_backend="epic"), "needs a disk tier"),
    (dict(pic_backend="epic", disk_cache_tokens=1000, host_cache_tokens=1000), "evictions to land on disk"),
], ids=["pic-off", "no-disk-tier", "a-host-tier"])
def test_an_engine_offline_prefill_cannot_use_is_refused_and_shut_down(checkpoint_factory, tmp_path, options,
                                                                       message):
    model = str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"]))
    disk = {"disk_cache_path": str(tmp_path / "disk")} if "disk_cache_tokens" in options else {}
    engine = AsyncLLMEngine.from_config(EngineConfig.create(model, **options, **disk, **ENGINE))
    with pytest.raises(ValueError, match=message):
        OfflinePrefill(engine)
    assert not engine.stats().alive


def test_bad_lines_are_counted_with_line_numbers_and_the_rest_completes(checkpoint_factory, tmp_path):
    model = str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"]))
    lines = [
        {"id": "ok-1", "text": DOCUMENTS[0]},
        '{"text": "unterminated',
        "",  # blank lines are ignored
        {"id": "empty", "text": ""},
        {"id": "long", "token_ids": list(range(100, 200))},
        {"text": "a <pic>nested</pic> tag"},
        ["not", "an", "object"],
        {"token_ids": [1, "two"]},
        {"text": "both", "token_ids": [1]},
        {"id": 7, "token_ids": [10, 11, 10**9]},
        {"id": 8, "token_ids": [10, 11, 12]},
    ]
    report = run_prefill(model, tmp_path / "disk", write_corpus(tmp_path / "docs.jsonl", lines), max_model_len=64)
    assert (report.prefilled, report.skipped, report.failed) == (2, 0, 8)
    reasons = {f.line: (f.doc_id, f.reason) for f in report.failures}
    assert sorted(reasons) == [2, 4, 5, 6, 7, 8, 9, 10]
    assert "not valid JSON" in reasons[2][1]
    assert reasons[4] == ("empty", "empty document: it has no tokens")
    assert reasons[5][0] == "long" and "too long: 100 tokens" in reasons[5][1] and "max_model_len 64" in reasons[5][1]
    assert "<pic>" in reasons[6][1]
    assert "JSON object" in reasons[7][1]
    assert "list of integers" in reasons[8][1]
    assert "exactly one of" in reasons[9][1]
    assert reasons[10][0] == "7" and "outside the vocabulary" in reasons[10][1]


def test_a_disk_tier_smaller_than_the_corpus_reports_what_it_dropped(checkpoint_factory, tmp_path, corpus):
    model = str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"]))
    report = run_prefill(model, tmp_path / "disk", corpus, disk_cache_tokens=30)
    assert report.prefilled == 5 and report.evicted_from_disk >= 3


def test_prefill_command_reports_progress_counts_and_bad_lines(checkpoint_factory, tmp_path):
    model = str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"]))
    corpus = write_corpus(tmp_path / "docs.jsonl", [{"text": DOCUMENTS[0]}, "{oops", {"text": DOCUMENTS[1]},
                                                    {"text": DOCUMENTS[2]}])
    args = ["--model", model, "--input", corpus, "--disk-cache-path", str(tmp_path / "disk"), "--page-size", "4",
            "--num-pages", "64"]
    runner = CliRunner()
    first = runner.invoke(prefill, args + ["--limit", "3"])
    assert first.exit_code == 0, first.output
    assert "line 2: not valid JSON" in first.output
    assert "prefilled 2 documents" in first.output and "skipped 0" in first.output and "failed 1" in first.output
    again = runner.invoke(prefill, args)
    assert again.exit_code == 0, again.output
    assert "prefilled 1 documents" in again.output and "skipped 2" in again.output


def test_prefill_command_errors_name_the_problem(checkpoint_factory, tmp_path):
    model = str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"]))
    disk = str(tmp_path / "disk")
    corpus = write_corpus(tmp_path / "docs.jsonl", [{"text": DOCUMENTS[0]}])
    runner = CliRunner()
    cases = [
        (["--model", model, "--input", str(tmp_path / "missing.jsonl"), "--disk-cache-path", disk], "no such file"),
        (["--model", "/no/such/dir", "--input", corpus, "--disk-cache-path", disk], "no checkpoint directory"),
        (["--model", model, "--input", corpus, "--disk-cache-path", disk, "--pic-backend", "blend"],
         "unknown PIC backend"),
        (["--model", model, "--input", corpus], "--disk-cache-path"),
    ]
    for args, message in cases:
        result = runner.invoke(prefill, args + ["--num-pages", "32"])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output


def test_a_failed_disk_write_stops_the_run_and_keeps_what_was_written(checkpoint_factory, tmp_path, corpus):
    model = str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"]))
    disk = tmp_path / "disk"
    runner = OfflinePrefill(build_prefill_engine(model, disk, "epic", **ENGINE), batch_size=1)
    ids = runner.requests.tokenizer.encode_plain(DOCUMENTS[2])
    blocker = disk / f".pic-{runner.kv.segment_key(ENGINE_DEFAULT, ids)}.kv.tmp"
    blocker.mkdir()  # the third document's write will fail
    with pytest.raises(OSError, match="1 disk tier write"):
        runner.run(corpus)
    runner.close()
    blocker.rmdir()
    resumed = run_prefill(model, disk, corpus)
    assert (resumed.prefilled, resumed.skipped, resumed.failed) == (3, 2, 0)

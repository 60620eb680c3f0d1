"""The results pages tools write under docs/results (``--write-docs``): machine, command, date, tables, plot."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from nebula_engine.bench.results_page import (Machine, ResultsPage, Table, cpu_model, invoked_command, memory_gib,
                                              write_page)

MACHINE = Machine(cpu="Test CPU 9000", cores=2, memory_gib=7.75, os="Linux-6.1-x86_64", python="3.11.9",
                  torch="2.13.0")
DATE = datetime.date(2030, 1, 2)


def page(**overrides) -> ResultsPage:
    settings = dict(name="engine-speed", title="Engine speed", about="Tokens per second, ours against transformers.",
                    tables=(Table(("figure", "ours", "HF"), (("prefill", "1.5", "1.0"), ("decode", 2, 1))),),
                    command="python tools/bench_forward.py --write-docs")
    return ResultsPage(**{**settings, **overrides})


def test_page_names_machine_command_date_and_table(tmp_path):
    path = write_page(page(notes=("ratios above 1: ours is faster",)), tmp_path, MACHINE, DATE)
    assert path == tmp_path / "engine-speed.md"
    text = path.read_text()
    assert text.startswith("# Engine speed\n\nTokens per second, ours against transformers.\n")
    assert "Written by `python tools/bench_forward.py --write-docs` on 2030-01-02." in text
    for line in ("- CPU: Test CPU 9000, 2 cores", "- memory: 7.8 GiB", "- OS: Linux-6.1-x86_64",
                 "- Python 3.11.9, torch 2.13.0"):
        assert line in text.splitlines()
    assert "| figure | ours | HF |\n|---|---|---|\n| prefill | 1.5 | 1.0 |\n| decode | 2 | 1 |" in text
    assert "- ratios above 1: ours is faster" in text
    assert "![" not in text


def test_png_is_copied_beside_the_page_and_embedded(tmp_path):
    plot = tmp_path / "run" / "compare.png"
    plot.parent.mkdir()
    plot.write_bytes(b"\x89PNG fake")
    out = tmp_path / "docs"
    path = write_page(page(name="main-job", title="Main job", png=plot), out, MACHINE, DATE)
    assert (out / "main-job.png").read_bytes() == b"\x89PNG fake"
    assert path.read_text().rstrip().endswith("![Main job](main-job.png)")
    write_page(page(name="main-job", title="Main job", png=out / "main-job.png"), out, MACHINE, DATE)  # in place
    assert (out / "main-job.png").read_bytes() == b"\x89PNG fake"


def test_a_missing_plot_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.png"):
        write_page(page(png=tmp_path / "nowhere.png"), tmp_path, MACHINE, DATE)


def test_cells_cannot_break_the_table():
    table = Table(("a", "b"), (("x|y", "two\nlines"),), caption="Caption.")
    assert table.markdown() == "Caption.\n\n| a | b |\n|---|---|\n| x\\|y | two lines |"


@pytest.mark.parametrize("bad", [dict(name="docs/x"), dict(name="x.md"), dict(name=""), dict(tables=())])
def test_bad_pages_are_refused(bad):
    with pytest.raises(ValueError):
        page(**bad)


def test_rows_must_match_the_header():
    with pytest.raises(ValueError, match="2 cells"):
        Table(("a", "b"), (("1", "2"), ("3",)))


def test_invoked_command_reads_as_typed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "tools" / "validate_sim.py"
    assert invoked_command([str(script), "--write-docs"]) == "python tools/validate_sim.py --write-docs"
    assert invoked_command(["/venv/bin/nebula-engine", "compare", "--qps", "0.5"]) == "nebula-engine compare --qps 0.5"
    assert invoked_command(["/elsewhere/x.py", "a b"]) == "python /elsewhere/x.py 'a b'"


def test_machine_facts_from_proc_files(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t: avx2\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        8126464 kB\nMemFree: 1 kB\n")
    assert cpu_model(cpuinfo) == "AMD EPYC 9B14"
    assert memory_gib(meminfo) == pytest.approx(7.75)
    assert cpu_model(tmp_path / "missing")  # falls back to what platform knows, never empty
    here = Machine.here()
    assert here.cores >= 1 and here.python and here.os


def test_main_job_page_from_compare_json(tmp_path):
    from nebula_engine.bench.cluster_compare import CompareOptions, main_job_page

    options = {**CompareOptions().__dict__, "kv_tokens_per_peer": 18_432}
    row = dict(failed=0, transfer_bytes=3 * 2**20, peer_cpu_s=41.0, host_steal=0.02)
    document = {"model": "/cache/bench-qwen3", "options": options, "hit_ratio_bound": 0.455,
                "pc_hit_ratio_bound": 0.288,
                "rows": [dict(row, policy="pc", ttft_p50_s=0.8, ttft_p99_s=1.6, cache_hit_ratio=0.263),
                         dict(row, policy="nebula", ttft_p50_s=0.4, ttft_p99_s=1.2, cache_hit_ratio=0.426,
                              peer_cpu_s=None, host_steal=None)]}
    plot = tmp_path / "compare.png"
    plot.write_bytes(b"\x89PNG")
    text = write_page(main_job_page(document, plot), tmp_path / "docs", MACHINE, DATE).read_text()
    assert "| pc | 0.800 | 1.600 | 26.3% | 1.00 | 1.00 | 0 | 3.0 MB | 41.0s | 2.0% |" in text
    assert "| nebula | 0.400 | 1.200 | 42.6% | 0.50 | 0.75 | 0 | 3.0 MB | n/a | n/a |" in text
    assert "| model | bench-qwen3 |" in text
    assert "| reuse bound of the slice | 45.5% (prefix caching alone 28.8%) |" in text
    assert "| KV per peer | 1,152 pages x 16 = 18,432 tokens |" in text
    assert "- CHR: cache hit ratio" in text and (tmp_path / "docs" / "main-job.png").exists()

"""One table over several PIC quality pages (``pic_quality.py --summary PAGE ...``): how quality grows with model size.

Reads the pages ``pic_quality_rag`` wrote (docs/results/PAGE.md: the description line and the results table), so
the comparison is rebuilt from what is committed, and writes docs/results/pic-quality-by-size.md: per page (in the
order given) the default backend's row and the other rows named by ``--summary-backend``, each checked against the
quality goal: at most 20% of the reused tokens recomputed, next-token KL at most 0.03, reply top-1 (teacher-forced)
at least 0.97, and answers right within one of PIC off's count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from nebula_engine.bench.results_page import DOCS_RESULTS, ResultsPage, Table, write_page

SUMMARY_PAGE = "pic-quality-by-size"
DEFAULT_BACKENDS = ("cacheblend",)
# the quality goal PIC is held to on these prompts (the project's target for its default backend)
GOAL_MAX_RECOMPUTED = 0.20
GOAL_MAX_KL = 0.03
GOAL_MIN_TOP1 = 0.97
GOAL_ANSWER_SLACK = 1

DESCRIPTION = re.compile(r"^(?P<model>\S+) \(documents prefilled [^)]*\): (?P<prompts>\d+) prompts of "
                         r"(?P<tokens>\d+) tokens on average, (?P<reused>\d+)% of them in reused documents; PIC off "
                         r"answers \d+% correctly \((?P<right>\d+)/\d+\)\.$", re.MULTILINE)


@dataclass(frozen=True)
class QualityPage:
    """What a PIC quality page says: its model and prompts, PIC off's right answers, and its rows by backend."""

    name: str
    model: str
    num_prompts: int
    mean_tokens: int
    off_right: int
    rows: dict[str, dict[str, str]]

    @classmethod
    def read(cls, name: str, out_dir: Path = DOCS_RESULTS) -> QualityPage:
        path = out_dir / f"{name}.md"
        if not path.is_file():
            raise SystemExit(f"--summary: no results page {path}")
        text = path.read_text()
        described = DESCRIPTION.search(text)
        if described is None:
            raise SystemExit(f"--summary: {path} has no PIC quality description line (written by pic_quality_rag?)")
        lines = text.splitlines()
        header_at = next((i for i, line in enumerate(lines) if line.startswith("| backend |")), None)
        if header_at is None:
            raise SystemExit(f"--summary: {path} has no results table")
        header = cells(lines[header_at])
        rows = {}
        for line in lines[header_at + 2:]:
            if not line.startswith("|"):
                break
            row = dict(zip(header, cells(line)))
            rows[row["backend"]] = row
        return cls(name, described["model"], int(described["prompts"]), int(described["tokens"]),
                   int(described["right"]), rows)


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def goal_verdict(row: dict[str, str], num_prompts: int, off_right: int) -> tuple[int, str]:
    """(answers right, which parts of the goal the row misses: "met" when none)."""
    right = round(float(row["accuracy"]) * num_prompts)
    misses = []
    if float(row["recomputed"].rstrip("%")) / 100 > GOAL_MAX_RECOMPUTED:
        misses.append("recomputed")
    if float(row["KL next"]) > GOAL_MAX_KL:
        misses.append("KL")
    if float(row["top-1 tf"]) < GOAL_MIN_TOP1:
        misses.append("top-1")
    if right < off_right - GOAL_ANSWER_SLACK:
        misses.append("accuracy")
    return right, "met" if not misses else "misses " + ", ".join(misses)


def summary_table(pages: list[QualityPage], backends: tuple[str, ...]) -> Table:
    rows = []
    for page in pages:
        for backend in backends:
            row = page.rows.get(backend)
            if row is None:
                continue
            right, verdict = goal_verdict(row, page.num_prompts, page.off_right)
            rows.append((f"{page.model} ([{page.name}]({page.name}.md))", page.num_prompts, page.mean_tokens,
                         backend, row["recomputed"], row["KL next"], row["top-1 next"], row["top-1 tf"],
                         f"{right}/{page.num_prompts} (off {page.off_right})", verdict))
    return Table(("model (page)", "prompts", "tokens", "backend", "recomputed", "KL next", "top-1 next",
                  "top-1 tf", "right answers", "goal"), tuple(rows))


ABOUT = ("The PIC quality pages side by side, smallest model first: the same kind of prompts (4-6 invented-fact "
         "documents cached alone in one order and asked in another), each backend against PIC off on that model. "
         f"Goal: at most {GOAL_MAX_RECOMPUTED:.0%} of the reused tokens recomputed, next-token KL at most "
         f"{GOAL_MAX_KL}, reply top-1 (teacher-forced) at least {GOAL_MIN_TOP1}, and answers right within "
         f"{GOAL_ANSWER_SLACK} of PIC off.")


def write_summary(names: list[str], backends: tuple[str, ...] = DEFAULT_BACKENDS,
                  out_dir: Path = DOCS_RESULTS) -> Path:
    pages = [QualityPage.read(name, out_dir) for name in names]
    table = summary_table(pages, backends)
    print(table.markdown())
    page = ResultsPage(SUMMARY_PAGE, "PIC quality by model size", ABOUT, (table,),
                       notes=("Each row is copied from its page, which names the run and the machine; KL in nats.",))
    path = write_page(page, out_dir)
    print(f"wrote {path}")
    return path

"""A workload's Table 1/2 figures beside the paper's, as text or JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from nebula_engine.workloads.analysis import (
    Distribution, ReuseStats, SegmentStats, logged_size_ratio, reuse_stats, segment_stats,
)
from nebula_engine.workloads.paper_figures import PAPER_FIGURES, PaperFigures
from nebula_engine.workloads.request import Request


@dataclass(frozen=True)
class WorkloadReport:
    name: str
    reuse: ReuseStats
    segments: SegmentStats
    paper: PaperFigures
    logged_size_ratio: Distribution | None
    notes: tuple[str, ...]


def build_report(name: str, requests: list[Request], notes: tuple[str, ...]) -> WorkloadReport:
    return WorkloadReport(name, reuse_stats(requests), segment_stats(requests), PAPER_FIGURES[name],
                          logged_size_ratio(requests), notes)


def _triple(values) -> str:
    return " / ".join(f"{round(v):d}" for v in values)


def format_text(report: WorkloadReport) -> str:
    reuse, paper = report.reuse, report.paper
    lines = [f"{report.name} ({paper.paper_name}): {reuse.num_requests:,} requests, "
             f"{reuse.total_tokens:,} input tokens"]
    lines += [f"  note: {note}" for note in report.notes]
    lines += ["", f"Table 1 (% of input tokens)  {'ours':>8} {'paper':>8}"]
    for label, ours, theirs in (("PC%", reuse.pc, paper.pc), ("PIC%", reuse.pic, paper.pic),
                                ("NPHR%", reuse.nphr, paper.nphr), ("PMRR%", reuse.pmrr, paper.pmrr)):
        lines.append(f"  {label:<27}{ours:>8.2f} {theirs:>8g}")
    lines += ["", f"Table 2 (P50 / P95 / P99)    {'ours':>18}   {'paper':>18}"]
    segs = report.segments
    for label, ours, theirs in (
            ("segments/request", segs.segments_per_request, paper.segments_per_request),
            ("segment length (tokens)", segs.segment_length, paper.segment_length)):
        lines.append(f"  {label:<27}{_triple((ours.p50, ours.p95, ours.p99)):>18}   {_triple(theirs):>18}")
    if report.logged_size_ratio is not None:
        ratio = report.logged_size_ratio
        lines += ["", f"rebuilt / logged prompt_tokens: median {ratio.p50:.3f} "
                      f"(P95 {ratio.p95:.3f}, P99 {ratio.p99:.3f})"]
    return "\n".join(lines)


def format_json(report: WorkloadReport) -> str:
    reuse = report.reuse
    payload = {
        "workload": report.name,
        "hit_ratio_bound": reuse.pic / 100,  # the most any cache can hit (PIC), as a ratio
        "pc_hit_ratio_bound": reuse.pc / 100,  # the most prefix caching alone can hit
        "notes": list(report.notes),
        "ours": {
            "requests": reuse.num_requests, "input_tokens": reuse.total_tokens,
            "pc": reuse.pc, "pic": reuse.pic, "nphr": reuse.nphr, "pmrr": reuse.pmrr,
            "segments_per_request": asdict(report.segments.segments_per_request),
            "segment_length": asdict(report.segments.segment_length),
            "logged_size_ratio": asdict(report.logged_size_ratio) if report.logged_size_ratio else None,
        },
        "paper": asdict(report.paper),
    }
    return json.dumps(payload, indent=2, ensure_ascii=False)

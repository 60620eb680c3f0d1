"""The paper's reference figures (arXiv 2611.09474, Table 1 and Table 2), keyed by workload name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PaperFigures:
    paper_name: str
    pc: float
    pic: float
    nphr: float
    pmrr: float
    segments_per_request: tuple[int, int, int]  # P50, P95, P99
    segment_length: tuple[int, int, int]  # tokens, P50, P95, P99


PAPER_FIGURES: dict[str, PaperFigures] = {
    "doc2dial": PaperFigures("ChatRAG-doc2dial", 2.63, 99.68, 97.06, 99.7, (106, 112, 113), (334, 670, 1190)),
    "quac": PaperFigures("ChatRAG-QuAC", 3.15, 87.50, 84.36, 87.1, (35, 127, 203), (536, 773, 939)),
    "ragpulse": PaperFigures("RAGPulse", 31.53, 72.01, 40.48, 59.1, (11, 13, 15), (319, 521, 521)),
    "swe-agent": PaperFigures("nebius-SWE-agent", 95.26, 97.49, 2.23, 47.0, (31, 253, 413), (69, 1032, 1431)),
    "tau-bench": PaperFigures("τ-bench-Retail", 92.62, 96.69, 4.07, 55.1, (14, 34, 44), (93, 1240, 1240)),
    "chatdev": PaperFigures("ChatDev", 77.59, 96.57, 18.98, 84.7, (22, 65, 73), (818, 2253, 2780)),
}

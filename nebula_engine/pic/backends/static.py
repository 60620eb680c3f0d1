"""Backends whose recomputed rows F are fixed before the forward: ``full``, ``naive``, ``epic``.

- ``full``: F = every token after the exact prefix. Plain prefill; the exactness baseline.
- ``naive``: F = fresh tokens only; reused K/V is taken as is (no recompute).
- ``epic`` (EPIC / LegoLink, spec B2): F = fresh tokens ∪ the first ``k`` tokens of every reused segment that does
  not start the prompt. Recomputed through every layer; no other token's hidden state is ever computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nebula_engine.pic.backends.base import PICBackend
from nebula_engine.pic.combine import CombineResult, CombineRun, blended_forward_many
from nebula_engine.pic.layout import CombineLayout


class StaticRowsBackend(PICBackend):
    def rows(self, layout: CombineLayout) -> list[int]:
        raise NotImplementedError

    def combine(self, run: CombineRun) -> CombineResult:
        return self.combine_many([run])[0]

    def combine_many(self, runs: list[CombineRun]) -> list[CombineResult]:
        return blended_forward_many(runs, [run.positions(self.rows(run.layout)) for run in runs])

    def combine_cost(self, layout: CombineLayout, num_layers: int) -> float:
        return float(len(self.rows(layout)))


@dataclass(frozen=True)
class FullRecompute(StaticRowsBackend):
    name: ClassVar[str] = "full"

    def rows(self, layout: CombineLayout) -> list[int]:
        return list(range(layout.prefix_len, layout.num_tokens))


@dataclass(frozen=True)
class NaiveReuse(StaticRowsBackend):
    name: ClassVar[str] = "naive"

    def rows(self, layout: CombineLayout) -> list[int]:
        return layout.fresh_positions


@dataclass(frozen=True)
class EPIC(StaticRowsBackend):
    name: ClassVar[str] = "epic"
    k: int = 16  # tokens recomputed at the head of each reused segment
    exact_settings: ClassVar = {"k": 1 << 30}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"epic: k must be a non-negative integer, got {self.k!r}")

    def rows(self, layout: CombineLayout) -> list[int]:
        return sorted(set(layout.fresh_positions) | set(segment_heads(layout, self.k)))


def segment_heads(layout: CombineLayout, width: int) -> list[int]:
    """Reused positions among the first ``width`` tokens of each segment that does not start the prompt."""
    heads = []
    for span in layout.reused:
        if span.segment_start > 0:
            heads.extend(range(span.start, min(span.end, span.segment_start + width)))
    return heads

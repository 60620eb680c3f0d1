"""EPIC / LegoLink (spec B2), ``epic``: recompute the first ``k`` tokens of every reused segment.

F = fresh tokens ∪ the first ``k`` tokens of every reused segment that does not start the prompt. Recomputed
through every layer; no other token's hidden state is ever computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nebula_engine.pic.backends.static_rows import StaticRowsBackend
from nebula_engine.pic.layout import CombineLayout


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

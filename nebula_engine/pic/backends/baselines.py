"""The two baselines every PIC algorithm sits between: ``full`` and ``naive``.

- ``full``: F = every token after the exact prefix. Plain prefill; the exactness baseline.
- ``naive``: F = fresh tokens only; reused K/V is taken as is (no recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nebula_engine.pic.backends.static_rows import StaticRowsBackend
from nebula_engine.pic.layout import CombineLayout


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

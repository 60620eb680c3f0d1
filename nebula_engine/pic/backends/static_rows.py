"""The base of backends whose recomputed rows F are fixed before the forward (``full``, ``naive``, ``epic``).

Such a backend only says which rows F it recomputes; those rows run through every layer of one blended forward,
and no other token's hidden state is ever computed. Its combine cost is ``|F|``.
"""

from __future__ import annotations

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

"""The base of backends that choose the recomputed rows inside the forward, at check layers (``cacheblend``, ``a3``).

Layers before the (first) check layer and the check layer itself run on every token after the prefix
(their fresh K/V replace the placed ones); the check layer then keeps the fresh tokens plus the selected
reused ones, and later layers run on those rows only (spec B1, B3). A subclass scores the reused tokens
(``before`` and ``select``); ``keep`` turns scores into the rows kept. ``sink=n`` always keeps the first ``n``
tokens of each reused segment not starting the prompt (EPIC's sink heads) inside the ratio's budget.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from nebula_engine.kernels.pic_ops import select_top_tokens
from nebula_engine.pic.backends.base import PICBackend
from nebula_engine.pic.backends.epic import segment_heads
from nebula_engine.pic.combine import CombineResult, CombineRun, blended_forward_many, cached_values
from nebula_engine.pic.layout import CombineLayout


class CheckLayerBackend(PICBackend):
    check_layers: tuple[int, ...]

    def _validate(self, ratios: tuple[float, ...]) -> None:
        if not self.check_layers or any(not isinstance(c, int) or c < 0 for c in self.check_layers):
            raise ValueError(f"{self.name}: check layers must be non-negative integers, got {self.check_layers!r}")
        if list(self.check_layers) != sorted(set(self.check_layers)):
            raise ValueError(f"{self.name}: check layers must be increasing, got {self.check_layers!r}")
        if len(ratios) != len(self.check_layers) or any(not 0.0 <= r <= 1.0 for r in ratios):
            raise ValueError(f"{self.name}: one recompute ratio in [0, 1] per check layer, got {ratios!r}")
        if not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"{self.name}: sink must be a non-negative integer, got {self.sink!r}")

    def check_model(self, model) -> None:
        super().check_model(model)
        num_layers = len(model.model.layers)
        if self.check_layers[-1] >= num_layers:
            raise ValueError(f"{self.name}: check layer {self.check_layers[-1]} but the model has {num_layers} layers")

    def combine(self, run: CombineRun) -> CombineResult:
        return self.combine_many([run])[0]

    def combine_many(self, runs: list[CombineRun]) -> list[CombineResult]:
        rows = [run.positions(range(run.layout.prefix_len, run.layout.num_tokens)) for run in runs]
        return blended_forward_many(runs, rows, self)

    sink: int  # first tokens of each reused segment always kept (within the ratio's budget)

    def keep(self, run: CombineRun, rows: torch.Tensor, scores: torch.Tensor, ratio: float) -> torch.Tensor:
        """Indices into ``rows``: every fresh row plus the ``ratio`` share of reused tokens: the first ``sink`` of
        each segment not starting the prompt (EPIC's attention-sink heads), then those with top ``scores``
        (``scores`` [R] over the reused rows still in ``rows``, in order)."""
        reused_positions = run.layout.reused_position_set
        reused = torch.tensor([p in reused_positions for p in rows.tolist()], device=rows.device, dtype=torch.bool)
        reused_index = reused.nonzero().flatten()
        chosen = reused_index[top_reused(run.layout, rows[reused_index], scores, ratio, self.sink)]
        return torch.cat([(~reused).nonzero().flatten(), chosen]).sort().values

    def reused_rows(self, run: CombineRun, rows: torch.Tensor) -> torch.Tensor:
        reused = run.layout.reused_position_set
        return rows[torch.tensor([p in reused for p in rows.tolist()], device=rows.device, dtype=torch.bool)]

    def combine_cost(self, layout: CombineLayout, num_layers: int) -> float:
        """Full rows through the layers up to the last check, selected rows afterwards."""
        full_layers = min(self.check_layers[-1] + 1, num_layers)
        selected = len(layout.fresh_positions) + math.floor(self._final_ratio() * layout.num_reused)
        return (full_layers * layout.num_computed + (num_layers - full_layers) * selected) / num_layers

    def _final_ratio(self) -> float:
        raise NotImplementedError


def top_reused(layout: CombineLayout, reused: torch.Tensor, scores: torch.Tensor, ratio: float,
               sink: int) -> torch.Tensor:
    """Indices into ``reused`` (positions [R] of reused tokens, ``scores`` [R]) of the ``ratio`` share of the
    layout's reused tokens: the first ``sink`` of each segment not starting the prompt (EPIC's attention-sink heads),
    then those with top ``scores``."""
    count = min(int(math.floor(ratio * layout.num_reused + 1e-9)), reused.numel())
    if sink:
        heads = set(segment_heads(layout, sink))
        is_head = torch.tensor([int(p) in heads for p in reused.tolist()], device=scores.device, dtype=torch.bool)
        scores = torch.where(is_head, torch.full_like(scores, float("inf")), scores)
    if not count:
        return torch.zeros(0, dtype=torch.int64, device=scores.device)
    return select_top_tokens(scores, count)


def question_queries_and_keys(run: CombineRun, layer_idx: int, recorded: Mapping[str, torch.Tensor],
                              question: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """At a check layer, the question's queries [Lq, H, D] (``question``: [rows] bool) and the keys at ``positions``
    [P, H, D] (GQA keys repeated; MLA keys decompressed), as attention sees them there."""
    if "q" in recorded:
        q = recorded["q"][question]
        k = cached_values(run, layer_idx, positions, "key")  # [P, Hkv, D]
        return q, k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).to(q.dtype)
    layer = run.model.attention_layers()[layer_idx]
    latent = cached_values(run, layer_idx, positions, "value")
    k_pe = cached_values(run, layer_idx, positions, "key")
    keys, _ = layer.decompress(latent.to(recorded["q_nope"].dtype), k_pe.to(recorded["q_nope"].dtype))
    q = torch.cat([recorded["q_nope"], recorded["q_pe"]], dim=-1)[question]
    return q, keys

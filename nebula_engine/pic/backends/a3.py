"""A3 (spec B3), ``a3``: recompute the reused tokens the question attends to most, chosen at one check layer.

``s_j = Σ_t softmax_j(q_t·k_j / √(H·D))`` with heads concatenated, smoothed by a width-5 average, over the tokens
after the last reused span (the question); the softmax runs over the reused tokens' keys, or with
``softmax="context"`` over every key each question token attends to (prefix and fresh tokens included, causal),
scoring the reused ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F

from nebula_engine.pic.backends.check_layer import CheckLayerBackend, question_queries_and_keys
from nebula_engine.pic.combine import CombineRun


@dataclass(frozen=True)
class A3(CheckLayerBackend):
    name: ClassVar[str] = "a3"
    ratio: float = 0.15
    check_layers: tuple[int, ...] = (1,)
    pool_kernel: int = 5  # odd width of the average smoothing of the scores
    sink: int = 0
    softmax: str = "reused"  # over the reused tokens' keys, or "context": every key the question attends to
    exact_settings: ClassVar = {"ratio": 1.0}

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.check_layers) != 1:
            raise ValueError(f"a3 selects at one check layer, got {self.check_layers!r}")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"a3: pool_kernel must be a positive odd integer, got {self.pool_kernel!r}")
        if self.softmax not in ("reused", "context"):
            raise ValueError(f"a3: softmax must be 'reused' or 'context', got {self.softmax!r}")
        self._validate((self.ratio,))

    def _final_ratio(self) -> float:
        return self.ratio

    def before(self, layer_idx, run, rows):
        return None

    def select(self, layer_idx: int, run: CombineRun, rows: torch.Tensor, before: Any,
               recorded: Mapping[str, torch.Tensor]) -> torch.Tensor:
        reused = self.reused_rows(run, rows)
        if reused.numel() == 0:
            return torch.arange(rows.numel(), device=rows.device)
        question = rows >= run.layout.question_start
        if self.softmax == "context":  # every key up to each question token; the reused columns scored
            keyed = run.positions(range(run.layout.num_tokens))
        else:
            keyed = reused
        queries, keys = question_queries_and_keys(run, layer_idx, recorded, question, keyed)
        logits = queries.flatten(1) @ keys.flatten(1).t() / math.sqrt(queries.shape[1] * queries.shape[2])
        if self.softmax == "context":
            future = keyed[None, :] > rows[question][:, None]
            logits = logits.masked_fill(future, float("-inf"))
        scores = logits.float().softmax(dim=-1).sum(dim=0)  # [R] (context: [N])
        if self.softmax == "context":
            scores = scores[reused]
        pad = self.pool_kernel // 2
        smoothed = F.avg_pool1d(scores[None, None], self.pool_kernel, stride=1, padding=pad,
                                count_include_pad=True)[0, 0]
        return self.keep(run, rows, smoothed, self.ratio)

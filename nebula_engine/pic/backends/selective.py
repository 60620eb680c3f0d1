"""Backends that choose the recomputed rows inside the forward, at check layers: ``cacheblend``, ``a3``.

Layers before the (first) check layer and the check layer itself run on every token after the prefix
(their fresh K/V replace the placed ones); the check layer then keeps the fresh tokens plus the selected
reused ones, and later layers run on those rows only (spec B1, B3).

- ``cacheblend``: select the reused tokens whose K/V moved most, ``Σ(new − old)²`` over V (MLA: the latent c̃)
  or, with ``deviation="key"``, over post-RoPE K (LMCache's variant). Several check layers filter gradually,
  each keeping ``ratio_i`` of the reused tokens among those still selected.
- ``a3``: select the reused tokens the question attends to most: ``s_j = Σ_t softmax_j(q_t·k_j / √(H·D))`` with
  heads concatenated, smoothed by a width-5 average, over the tokens after the last reused span (the question);
  the softmax runs over the reused tokens' keys, or with ``softmax="context"`` over every key each question token
  attends to (prefix and fresh tokens included, causal), scoring the reused ones.
- both: ``sink=n`` always keeps the first ``n`` tokens of each reused segment not starting the prompt (EPIC's
  sink heads) inside the ratio's budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F

from nebula_engine.kernels.pic_dispatch import pic_op
from nebula_engine.kernels.pic_ops import select_top_tokens
from nebula_engine.pic.backends.base import PICBackend
from nebula_engine.pic.combine import CombineResult, CombineRun, blended_forward_many, cached_values
from nebula_engine.pic.backends.static import segment_heads
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
        count = min(int(math.floor(ratio * run.layout.num_reused + 1e-9)), int(reused.sum()))
        reused_index = reused.nonzero().flatten()
        if self.sink:
            heads = set(segment_heads(run.layout, self.sink))
            is_head = torch.tensor([int(p) in heads for p in rows[reused_index].tolist()], device=rows.device,
                                   dtype=torch.bool)
            scores = torch.where(is_head, torch.full_like(scores, float("inf")), scores)
        chosen = reused_index[select_top_tokens(scores, count)] if count else reused_index[:0]
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


@dataclass(frozen=True)
class CacheBlend(CheckLayerBackend):
    name: ClassVar[str] = "cacheblend"
    ratio: float = 0.15  # share of reused tokens recomputed (per check layer when several)
    check_layers: tuple[int, ...] = (1,)
    ratios: tuple[float, ...] = ()  # per check layer (gradual filtering); empty: ``ratio`` at every one
    deviation: str = "value"  # "value" (CacheBlend) | "key" (LMCache)
    # each segment's first 4 tokens kept: on SmolLM2's 12 fictional-fact prompts (tools/pic_quality.py) at 15%
    # recomputed, reply KL 0.194 -> 0.173 (lower on 10 of 12 prompts), next-token KL 0.080 either way (lower on 8)
    sink: int = 4
    exact_settings: ClassVar = {"ratio": 1.0}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.deviation not in ("value", "key"):
            raise ValueError(f"cacheblend: deviation must be 'value' or 'key', got {self.deviation!r}")
        self._validate(self._ratios())

    def _ratios(self) -> tuple[float, ...]:
        return self.ratios or (self.ratio,) * len(self.check_layers)

    def _final_ratio(self) -> float:
        return self._ratios()[-1]

    def before(self, layer_idx: int, run: CombineRun, rows: torch.Tensor) -> Any:
        reused = self.reused_rows(run, rows)
        return reused, cached_values(run, layer_idx, reused, self.deviation)

    def select(self, layer_idx, run, rows, before, recorded):
        reused, old = before
        if reused.numel() == 0:
            return torch.arange(rows.numel(), device=rows.device)
        deviation = pic_op("kv_deviation", old.device)(old, cached_values(run, layer_idx, reused, self.deviation))
        return self.keep(run, rows, deviation, self._ratios()[self.check_layers.index(layer_idx)])


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
        queries, keys = self._queries_and_keys(run, layer_idx, recorded, question, keyed)
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

    @staticmethod
    def _queries_and_keys(run: CombineRun, layer_idx: int, recorded: Mapping[str, torch.Tensor],
                          question: torch.Tensor, reused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Question queries [Lq, H, D] and the keys at ``reused`` (positions) [R, H, D] (GQA keys repeated)."""
        if "q" in recorded:
            q = recorded["q"][question]
            k = cached_values(run, layer_idx, reused, "key")  # [R, Hkv, D]
            return q, k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).to(q.dtype)
        layer = run.model.attention_layers()[layer_idx]  # MLA: decompress the reused tokens' keys
        latent = cached_values(run, layer_idx, reused, "value")
        k_pe = cached_values(run, layer_idx, reused, "key")
        keys, _ = layer.decompress(latent.to(recorded["q_nope"].dtype), k_pe.to(recorded["q_nope"].dtype))
        q = torch.cat([recorded["q_nope"], recorded["q_pe"]], dim=-1)[question]
        return q, keys

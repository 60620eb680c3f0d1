"""Question-scouted selection, ``prophet``: recompute the reused tokens the question reads most, over every layer.

Two forwards, after ProphetKV's dual-stage recomputation (Wang et al., arXiv 2602.02579):
  1. the scout: the fresh rows only (the question and any text between documents) through every layer, over the
     reused K/V as placed, as ``naive`` would; at each attention layer the question's attention over every key it
     sees (causal, heads and question tokens summed) scores the reused tokens, and the layers' scores are summed;
  2. the combine: the fresh rows, each reused segment's first ``sink`` tokens and the top ``ratio`` share of the
     reused tokens by that score, through every layer; their fresh K/V replace the scout's and the placed ones.

Where CacheBlend ranks by how far a token's K/V moved at one early layer, this ranks by what the question reads at
every layer: on Qwen2.5-Coder-1.5B an oracle ranking by the full prefill's question attention times the true V
error, over every layer, reaches next-token top-1 1.00 at 20% recomputed where the deviation rule reaches 0.67
(``tools/pic_oracle.py``); the scout approximates that attention with the placed K/V. On the oracle's 12 prompts
at 20%: next-token KL 0.057, top-1 0.92 and 11 of 12 answers right, as with PIC off (the oracle: 0.051, 1.00, 11;
CacheBlend: 0.611, 0.67, 6). Cost: the fresh rows twice plus the selected rows, through every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from nebula_engine.model.base import LayerRows
from nebula_engine.pic.backends.base import PICBackend
from nebula_engine.pic.backends.check_layer import question_queries_and_keys, top_reused
from nebula_engine.pic.combine import CombineResult, CombineRun, blended_forward_many, combine_context
from nebula_engine.pic.layout import CombineLayout


@dataclass(frozen=True)
class Prophet(PICBackend):
    name: ClassVar[str] = "prophet"
    # share of reused tokens recomputed, the sink heads included. Qwen2.5-Coder-1.5B, 12 fact prompts: 0.15 -> KL
    # 0.076, 9/12 answers right; 0.2 -> KL 0.057, 11/12, as PIC off (tools/pic_quality.py; the goal allows 20%)
    ratio: float = 0.2
    # each segment's first 4 tokens kept, as CacheBlend's (measured there on SmolLM2's fictional-fact prompts)
    sink: int = 4
    # The options below, each measured on those 12 prompts at ratio 0.2 against the defaults' KL 0.057 and top-1
    # 0.92: sink=0 gives 0.057 and 0.92, first_layer=1 0.058 and 0.92, queries=last 0.077 and 1.00 (reply top-1
    # 0.93 against 0.94); pool_kernel=5 raised the KL on each of the first 4 prompts (mean 0.025 against 0.019).
    first_layer: int = 0  # attention layers scored: this one and every later one
    queries: str = "question"  # whose attention scores: every "question" token, or only the prompt's "last"
    pool_kernel: int = 1  # odd width of an average smoothing of the scores along the prompt (1: none)
    exact_settings: ClassVar = {"ratio": 1.0}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"prophet: ratio must be in [0, 1], got {self.ratio!r}")
        if not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"prophet: sink must be a non-negative integer, got {self.sink!r}")
        if not isinstance(self.first_layer, int) or self.first_layer < 0:
            raise ValueError(f"prophet: first_layer must be a non-negative integer, got {self.first_layer!r}")
        if not isinstance(self.pool_kernel, int) or self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"prophet: pool_kernel must be a positive odd integer, got {self.pool_kernel!r}")
        if self.queries not in QUERIES:
            raise ValueError(f"prophet: queries must be one of {', '.join(QUERIES)}, got {self.queries!r}")

    def check_model(self, model: nn.Module) -> None:
        super().check_model(model)
        num_layers = len(model.attention_layers())
        if self.first_layer >= num_layers:
            raise ValueError(f"prophet: first_layer {self.first_layer} but the model has {num_layers} attention layers")

    def combine(self, run: CombineRun) -> CombineResult:
        return self.combine_many([run])[0]

    def combine_many(self, runs: list[CombineRun]) -> list[CombineResult]:
        scores = question_attention_scores(runs, self.first_layer, self.queries == "last")
        return blended_forward_many(runs, [run.positions(self.rows(run, score)) for run, score in zip(runs, scores)])

    def rows(self, run: CombineRun, scores: torch.Tensor) -> list[int]:
        """The fresh rows, then the sink heads and the top-scoring reused tokens up to the ``ratio`` budget."""
        layout = run.layout
        reused = run.positions(layout.reused_positions)
        if self.pool_kernel > 1:
            scores = F.avg_pool1d(scores[None, None], self.pool_kernel, stride=1, padding=self.pool_kernel // 2,
                                  count_include_pad=True)[0, 0]
        chosen = reused[top_reused(layout, reused, scores[reused], self.ratio, self.sink)].tolist()
        return sorted(set(layout.fresh_positions) | set(chosen))

    def combine_cost(self, layout: CombineLayout, num_layers: int) -> float:
        fresh = len(layout.fresh_positions)
        return float(2 * fresh + math.floor(self.ratio * layout.num_reused))


QUERIES = ("question", "last")
# fp32 logits scored at once: 64 MiB, so a long prompt's question never needs [heads, question, prompt] at once
SCORE_CHUNK_ELEMENTS = 1 << 24


def question_attention_scores(runs: list[CombineRun], first_layer: int = 0,
                              last_only: bool = False) -> list[torch.Tensor]:
    """The scout forward of each run's fresh rows over its placed K/V: per run, [N] fp32, the question's attention
    to each position summed over the attention layers from ``first_layer`` on, heads and question tokens (or the
    prompt's last token alone), the softmax over every key a query sees. It writes the fresh rows' K/V, which the
    combine then overwrites."""
    rows = [run.positions(run.layout.fresh_positions) for run in runs]
    scout = _QuestionAttention(runs, rows, first_layer, last_only)
    token_ids = torch.cat([run.token_ids[part] for run, part in zip(runs, rows)])
    runs[0].model.run_layers(token_ids, torch.cat(rows), combine_context(runs, rows, recording=True), scout)
    return scout.scores


class _QuestionAttention:
    """Layer hook: after each (attention) layer, adds the question's attention there to each run's scores; the rows
    go on unchanged. The rows' context records the queries each layer attends with."""

    def __init__(self, runs: list[CombineRun], rows: list[torch.Tensor], first_layer: int, last_only: bool):
        self.runs, self.rows, self.first_layer = runs, rows, first_layer
        device = runs[0].token_ids.device
        self.scores = [torch.zeros(run.layout.num_tokens, dtype=torch.float32, device=device) for run in runs]
        self.keyed = [run.positions(range(run.layout.num_tokens)) for run in runs]  # every key a query may see
        self.question = [part >= (run.layout.num_tokens - 1 if last_only else run.layout.question_start)
                         for run, part in zip(runs, rows)]  # [rows] bool: the queries that score

    def __call__(self, layer_idx: int, layer: nn.Module, rows: LayerRows) -> LayerRows:
        hidden = layer(*rows)
        if layer_idx < self.first_layer:
            return rows._replace(hidden=hidden)
        start = 0
        for run, part, score, keyed, question in zip(self.runs, self.rows, self.scores, self.keyed, self.question):
            recorded = {name: value[start:start + part.numel()] for name, value in rows.attn_ctx.recorded.items()}
            start += part.numel()
            queries, keys = question_queries_and_keys(run, layer_idx, recorded, question, keyed)  # [Lq,H,D], [N,H,D]
            attention = run.model.attention_layers()[layer_idx]
            window = getattr(attention, "sliding_window", None)
            query_positions, keys = part[question], keys.float()
            step = max(1, SCORE_CHUNK_ELEMENTS // (keys.shape[0] * keys.shape[1]))
            for first in range(0, query_positions.numel(), step):  # [H, chunk, N] logits at a time, not [H, Lq, N]
                chunk = slice(first, first + step)
                logits = torch.einsum("thd,nhd->htn", queries[chunk].float(), keys) * attention.scale
                distance = query_positions[chunk, None] - keyed[None, :]  # [chunk, N]
                unseen = distance < 0
                if window is not None:  # a query sees only the last ``window`` keys, itself included
                    unseen |= distance >= window
                score += logits.masked_fill(unseen[None], float("-inf")).softmax(dim=-1).sum(dim=(0, 1))
        return rows._replace(hidden=hidden)

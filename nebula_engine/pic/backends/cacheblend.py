"""CacheBlend (spec B1), ``cacheblend``: recompute the reused tokens whose K/V moved most at the check layers.

The deviation is ``Σ(new − old)²`` over V (MLA: the latent c̃) or, with ``deviation="key"``, over post-RoPE K
(LMCache's variant). Several check layers filter gradually, each keeping ``ratio_i`` of the reused tokens among
those still selected.

``weight="question"`` ranks by what the question reads instead: per head, the attention the question's tokens pay a
reused token at the check layer times the norm of that token's V change there, summed over heads and question
tokens (the first-order change of the question's attention output). An oracle ranking by this product over every
layer, with the full prefill's attention and V error, reaches top-1 1.00 at 20% recomputed on Qwen2.5-Coder-1.5B
where the deviation rule reaches 0.67 (``tools/pic_oracle.py``); computed at check layer 1 or 3 alone it does not
(1.5B, the same 12 prompts at 20%: next-token KL 1.03 and 1.23 against the deviation rule's 0.61), so the default
stays the deviation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch

from nebula_engine.kernels.pic_dispatch import pic_op
from nebula_engine.pic.backends.check_layer import CheckLayerBackend, question_queries_and_keys
from nebula_engine.pic.combine import CombineRun, cached_values


@dataclass(frozen=True)
class CacheBlend(CheckLayerBackend):
    name: ClassVar[str] = "cacheblend"
    ratio: float = 0.15  # share of reused tokens recomputed (per check layer when several)
    check_layers: tuple[int, ...] = (1,)
    ratios: tuple[float, ...] = ()  # per check layer (gradual filtering); empty: ``ratio`` at every one
    deviation: str = "value"  # "value" (CacheBlend) | "key" (LMCache)
    weight: str = "none"  # "none": the deviation alone | "question": V change weighted by the question's attention
    # each segment's first 4 tokens kept: on SmolLM2's 12 fictional-fact prompts (tools/pic_quality.py) at 15%
    # recomputed, reply KL 0.194 -> 0.173 (lower on 10 of 12 prompts), next-token KL 0.080 either way (lower on 8)
    sink: int = 4
    exact_settings: ClassVar = {"ratio": 1.0}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.deviation not in ("value", "key"):
            raise ValueError(f"cacheblend: deviation must be 'value' or 'key', got {self.deviation!r}")
        if self.weight not in WEIGHTS:
            raise ValueError(f"cacheblend: weight must be one of {', '.join(WEIGHTS)}, got {self.weight!r}")
        if self.weight == "question" and self.deviation != "value":
            raise ValueError("cacheblend: weight=question weighs the V change; it needs deviation=value")
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
        new = cached_values(run, layer_idx, reused, self.deviation)
        question = rows >= run.layout.question_start
        if self.weight == "question" and bool(question.any()):
            scores = question_weighted_change(run, layer_idx, rows, recorded, question, reused, old, new)
        else:
            scores = pic_op("kv_deviation", old.device)(old, new)
        return self.keep(run, rows, scores, self._ratios()[self.check_layers.index(layer_idx)])


WEIGHTS = ("none", "question")


def question_weighted_change(run: CombineRun, layer_idx: int, rows: torch.Tensor, recorded: Mapping[str, torch.Tensor],
                             question: torch.Tensor, reused: torch.Tensor, old: torch.Tensor,
                             new: torch.Tensor) -> torch.Tensor:
    """[R] per reused token: Σ over heads h and question tokens t of softmax_t,h(q·k) times ‖ΔV‖ in h's KV group,
    the softmax over every key each question token attends to (causal)."""
    keyed = run.positions(range(run.layout.num_tokens))
    queries, keys = question_queries_and_keys(run, layer_idx, recorded, question, keyed)  # [Lq, H, D], [N, H, D]
    scale = run.model.attention_layers()[layer_idx].scale
    logits = torch.einsum("thd,nhd->htn", queries.float(), keys.float()) * scale
    future = keyed[None, :] > rows[question][:, None]  # [Lq, N]
    attention = logits.masked_fill(future[None], float("-inf")).softmax(dim=-1).sum(dim=1)[:, reused]  # [H, R]
    diff = new.float() - old.float()  # [R, Hkv, D] (MLA: [R, latent], one group)
    change = diff.reshape(diff.shape[0], diff.shape[1] if diff.dim() == 3 else 1, -1).norm(dim=-1)  # [R, Hkv]
    change = change.repeat_interleave(attention.shape[0] // change.shape[1], dim=1)  # [R, H]
    return (attention.t() * change).sum(dim=1)

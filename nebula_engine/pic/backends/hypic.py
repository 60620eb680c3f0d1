"""HYPIC (spec B4): PIC for hybrid models whose linear-attention layers keep a recurrent state.

A segment prefilled alone caches, per linear layer, the affine map its tail applies to the state,
``S -> M S + N`` (``GatedDeltaNet.transition``), and its last conv inputs; its full-attention K/V are cached
like every backend's. At combine time the first ``seam`` tokens of each reused segment (the seam, which also
covers the conv window) and every fresh token are recomputed through all layers; in a linear layer the state
flows through fresh runs by the recurrence and jumps over each cached tail by its map, so composing a
segment costs O(dk²·dv) whatever its length. Full-attention layers attend as in the blended forward.

Exact when ``seam`` covers every reused segment (nothing is composed). Near-exact otherwise: the tail's map was
computed from its isolated hidden states and conv window. On models without linear-attention layers HYPIC
is EPIC with ``k = seam``, the first segment included.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from nebula_engine.model.base import LayerRows
from nebula_engine.model.gated_deltanet import GatedDeltaNet, LinearAttentionState
from nebula_engine.pic.backends.base import PICBackend, SegmentPrefill, has_linear_attention
from nebula_engine.pic.combine import CombineResult, CombineRun, blended_forward
from nebula_engine.pic.layout import CombineLayout, ReusedSpan


@dataclass(frozen=True)
class HYPIC(PICBackend):
    name: ClassVar[str] = "hypic"
    handles_linear_attention: ClassVar[bool] = True
    seam: int = 16  # tokens recomputed at the head of each reused segment
    exact_settings: ClassVar = {"seam": 1 << 30}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.seam, int) or self.seam < 1:
            raise ValueError(f"hypic: seam must be a positive integer, got {self.seam!r}")

    def check_model(self, model: nn.Module) -> None:
        """The seam must hold a cached tail's whole conv window: with fewer than ``conv_kernel - 1`` recomputed
        tokens, the tail's first convolutions read tokens before the segment, which differ between the isolated
        prefill its map was computed in and the request (so even the first linear layer would be wrong)."""
        super().check_model(model)
        window = max((mixer.cfg.conv_kernel - 1 for mixer in model.linear_attention_layers()), default=0)
        if self.seam < window:
            raise ValueError(f"hypic: seam={self.seam} is below conv_kernel - 1 = {window} of this model's "
                             f"linear-attention layers; the seam must cover a cached tail's conv window "
                             f"(use seam >= {window})")

    @property
    def cache_format(self) -> str:
        return f"hypic-seam{self.seam}"  # the cached maps cover the tokens after the seam

    def prefill_segments(self, model: nn.Module, prefills: list[SegmentPrefill]) -> list[dict[str, Any]]:
        if not has_linear_attention(model):
            return super().prefill_segments(model, prefills)
        return [self.prefill_segment(model, prefill) for prefill in prefills]

    def prefill_segment(self, model: nn.Module, prefill: SegmentPrefill) -> dict[str, Any]:
        if not has_linear_attention(model):
            return super().prefill_segment(model, prefill)
        ids, positions, ctx = prefill.inputs()
        head = prefill.position_offset + self.seam  # rows before the cached tail
        hook = _MixLinearLayers(lambda linear_idx, mixer, normed: _segment_tail_map(mixer, normed, head))
        model.run_layers(ids, positions, ctx, hook)
        return {"position_offset": prefill.position_offset, "seam": self.seam, "linear": hook.extras}

    def composed_tails(self, run: CombineRun) -> list[ReusedSpan]:
        """Reused spans whose tail is composed from the cache (longer than the seam and not cut short)."""
        return [span for span in run.layout.reused
                if span.length > self.seam and span.entry_offset == 0
                and span.length == run.segments[span.segment_index].num_tokens]

    def rows(self, run: CombineRun) -> list[int]:
        composed = {span.segment_index for span in self.composed_tails(run)}
        rows = set(run.layout.fresh_positions)
        for span in run.layout.reused:
            rows.update(range(span.start, span.start + self.seam) if span.segment_index in composed
                        else range(span.start, span.end))
        return sorted(rows)

    def combine(self, run: CombineRun) -> CombineResult:
        if not has_linear_attention(run.model):
            return blended_forward(run, run.positions(self._epic_rows(run.layout)))
        if run.layout.prefix_len:
            raise ValueError("hypic needs the linear-attention states at the prefix end; start from position 0")
        rows = run.positions(self.rows(run))
        tails = self.composed_tails(run)
        hook = _MixLinearLayers(lambda linear_idx, mixer, normed:
                                self._linear_layer(mixer, normed, rows, tails, run, linear_idx))
        out = run.model.run_layers(run.token_ids[rows], rows, run.context(rows), hook)
        return CombineResult(out.hidden[-1:], run.layout.count_reused(rows.tolist()), hook.extras)

    def _linear_layer(self, mixer, normed: torch.Tensor, rows: torch.Tensor, tails: list[ReusedSpan],
                      run: CombineRun, linear_idx: int) -> tuple[torch.Tensor, LinearAttentionState]:
        """Fresh runs through the recurrence, cached tails by their maps, in prompt order."""
        outputs, state, cursor = [], None, 0
        positions = rows.tolist()
        for span in tails:
            tail_start = span.start + self.seam
            stop = _count_below(positions, tail_start, cursor)
            if stop > cursor:
                out, state = mixer(normed[cursor:stop], state)
                outputs.append(out)
                cursor = stop
            cached = run.segments[span.segment_index].state["linear"][linear_idx]
            recurrent = (mixer.empty_state(normed.dtype) if state is None else state).recurrent
            recurrent = torch.bmm(cached["M"].to(recurrent), recurrent) + cached["N"].to(recurrent)
            state = LinearAttentionState(cached["conv"].to(normed.dtype), recurrent)
        if cursor < len(positions):
            out, state = mixer(normed[cursor:], state)
            outputs.append(out)
        return torch.cat(outputs), state

    def _epic_rows(self, layout: CombineLayout) -> list[int]:
        rows = set(layout.fresh_positions)
        for span in layout.reused:
            rows.update(range(span.start, min(span.end, span.segment_start + self.seam)))
        return sorted(rows)

    def combine_cost(self, layout: CombineLayout, num_layers: int) -> float:
        return float(len(self._epic_rows(layout)))


class _MixLinearLayers:
    """Layer hook: attention layers run as they are; linear-attention layer ``l`` (its rank among them) mixes its
    normed input with ``mix(l, linear_attn, normed) -> (mixed, extra)``, the extras kept in ``extras``."""

    def __init__(self, mix: Callable[[int, nn.Module, torch.Tensor], tuple[torch.Tensor, Any]]):
        self.mix = mix
        self.extras: list = []

    def __call__(self, layer_idx: int, layer: nn.Module, rows: LayerRows) -> LayerRows:
        if not layer.is_linear:
            return rows._replace(hidden=layer(*rows)[0])
        hidden, extra = layer.forward_linear(rows.hidden, partial(self.mix, len(self.extras)))
        self.extras.append(extra)
        return rows._replace(hidden=hidden)


def _segment_tail_map(mixer: GatedDeltaNet, normed: torch.Tensor, head: int
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The segment through one linear layer from an empty state; cached: its last conv inputs and, when it is
    longer than ``head`` rows, the map ``S -> M S + N`` its tail (the rows after ``head``) applies to the state."""
    mixed, end = mixer(normed, None)
    entry = {"conv": end.conv}
    if normed.shape[0] > head:
        _, head_state = mixer(normed[:head], None)
        entry["M"], entry["N"] = mixer.transition(normed[head:], head_state.conv)
    return mixed, entry


def _count_below(positions: list[int], bound: int, start: int) -> int:
    """Index of the first position >= ``bound`` at or after ``start`` (positions sorted)."""
    index = start
    while index < len(positions) and positions[index] < bound:
        index += 1
    return index

"""The combine prefill's shared machinery: place cached segment KV at its new positions, then run the
blended forward (spec Part B) over a chosen set of rows F.

Legend: N = prompt tokens, F = recomputed rows (sorted positions), S = page size, Hd = hidden size.

``CombineRun`` is everything a backend needs about one request: its tokens, its layout, its pages (already
holding the exact prefix and the re-rotated reused KV) and the model. ``blended_forward`` runs the model's layer
loop (``CausalLM.run_layers``) on the rows F only: fresh K/V of F overwrite the placed ones, and row i attends to
every context key j <= position(i) (the exact partial-causal mask). At check layers a ``RowSelection`` may shrink F.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

import torch
from torch import nn

from nebula_engine.kernels.attention import AttentionBackend, AttentionContext, AttentionMetadata
from nebula_engine.kernels.mla_attention import MLAAttentionBackend
from nebula_engine.model.base import LayerRows
from nebula_engine.pic.layout import CombineLayout
from nebula_engine.pic.rope_shift import shift_cached_keys


@dataclass(frozen=True)
class CachedSegment:
    """A cached PIC segment as the combine sees it: its pages (in the same pool) and backend state."""

    pages: tuple[int, ...]
    num_tokens: int
    state: Mapping[str, Any]

    @property
    def position_offset(self) -> int:
        """Position its first token was computed at when prefilled alone (1 after a dropped BOS)."""
        return int(self.state.get("position_offset", 0))


class RecordingAttentionContext(AttentionContext):
    """Keeps the queries an attention layer passes in (A³ scores the question's queries against the context)."""

    recorded: dict[str, torch.Tensor]

    def attend(self, layer_idx, q, k, v, scale, sliding_window=None):
        self.recorded = {"q": q}
        return super().attend(layer_idx, q, k, v, scale, sliding_window)

    def attend_latent(self, layer_idx, q_nope, q_pe, latent, k_pe, params):
        self.recorded = {"q_nope": q_nope, "q_pe": q_pe}
        return super().attend_latent(layer_idx, q_nope, q_pe, latent, k_pe, params)


@dataclass
class CombineRun:
    model: nn.Module  # a CausalLM
    token_ids: torch.Tensor  # [N] int64
    layout: CombineLayout
    block_table: torch.Tensor  # [pages] int64, the request's pages
    page_size: int
    kv_caches: Sequence[tuple[torch.Tensor, ...]]
    attention_backend: AttentionBackend
    mla_backend: MLAAttentionBackend | None
    segments: Mapping[int, CachedSegment] = field(default_factory=dict)  # by PIC segment index, reused ones

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        return self.block_table[positions // self.page_size] * self.page_size + positions % self.page_size

    def context(self, rows: torch.Tensor, recording: bool = False) -> AttentionContext:
        """Attention for the new rows ``rows`` (sorted positions) of this one request."""
        count, total = rows.numel(), self.layout.num_tokens
        suffix = count > 0 and int(rows[0]) == total - count  # sorted and distinct: rows are the last ``count``
        # a suffix is an ordinary prefill chunk: the backend's causal path, no per-row mask to build
        meta = AttentionMetadata(query_start_loc=[0, count], seq_lens=[total],
                                 block_tables=self.block_table[None], slot_mapping=self.slots(rows),
                                 page_size=self.page_size, query_positions=None if suffix else rows)
        cls = RecordingAttentionContext if recording else AttentionContext
        return cls(self.attention_backend, meta, self.kv_caches, self.mla_backend)

    def positions(self, positions: Sequence[int]) -> torch.Tensor:
        return torch.tensor(positions, dtype=torch.int64, device=self.token_ids.device)


@dataclass(frozen=True)
class CombineResult:
    hidden: torch.Tensor  # [1, Hd] final-normed hidden state of the last prompt token
    num_recomputed: int  # reused tokens whose K/V was recomputed through the last layer
    linear_states: list | None = None  # per linear-attention layer, the state after the prompt (hybrids)


class RowSelection(Protocol):
    """Shrinks F at check layers (CacheBlend by KV deviation, A³ by question attention)."""

    check_layers: tuple[int, ...]

    def before(self, layer_idx: int, run: CombineRun, rows: torch.Tensor) -> Any: ...

    def select(self, layer_idx: int, run: CombineRun, rows: torch.Tensor, before: Any,
               ctx: RecordingAttentionContext) -> torch.Tensor:
        """Indices into ``rows`` to keep (sorted); must keep every fresh row."""


def blended_forward(run: CombineRun, rows: torch.Tensor, selection: RowSelection | None = None) -> CombineResult:
    """Decoder layers on rows F only (attention-only models); returns the last token's hidden state."""
    hook = None if selection is None else _SelectAtCheckLayers(run, selection)
    out = run.model.run_layers(run.token_ids[rows], rows, run.context(rows), hook)
    return CombineResult(out.hidden[-1:], run.layout.count_reused(out.positions.tolist()))


@dataclass(frozen=True)
class _SelectAtCheckLayers:
    """Layer hook: a check layer runs with a recording context, then only the rows ``selection`` keeps go on."""

    run: CombineRun
    selection: RowSelection

    def __call__(self, layer_idx: int, layer: nn.Module, rows: LayerRows) -> LayerRows:
        if layer_idx not in self.selection.check_layers:
            return rows._replace(hidden=layer(*rows))
        before = self.selection.before(layer_idx, self.run, rows.positions)
        ctx = self.run.context(rows.positions, recording=True)
        hidden = layer(rows.positions, rows.hidden, ctx)
        keep = self.selection.select(layer_idx, self.run, rows.positions, before, ctx)
        positions = rows.positions[keep]
        return LayerRows(positions, hidden[keep], self.run.context(positions))


def place_reused_kv(run: CombineRun) -> None:
    """Copy each reused span's cached K/V into the request's slots and re-rotate its keys by the position delta."""
    if not run.layout.reused:
        return
    src, dst, delta = [], [], []
    for span in run.layout.reused:
        segment = run.segments[span.segment_index]
        index = torch.arange(span.entry_offset, span.entry_offset + span.length)
        pages = torch.tensor(segment.pages, dtype=torch.int64)
        src.append(pages[index // run.page_size] * run.page_size + index % run.page_size)
        dst.append(torch.arange(span.start, span.end))
        delta.append(torch.arange(span.start, span.end) - (index + segment.position_offset))
    device = run.block_table.device
    src_slots = torch.cat(src).to(device)
    dst_slots = run.slots(torch.cat(dst).to(device))
    deltas = torch.cat(delta).to(device)
    for layer, tensors in zip(run.model.attention_layers(), run.kv_caches):
        for cache in tensors:
            flat = cache.view(-1, *cache.shape[2:])
            flat[dst_slots] = flat[src_slots]
        shift_cached_keys(tensors[0], dst_slots, deltas, layer.rotary, layer.latent_rope_dim)


def cached_values(run: CombineRun, layer_idx: int, positions: torch.Tensor, which: str) -> torch.Tensor:
    """[T, ...] what attention layer ``layer_idx`` holds at ``positions``: ``"value"`` (V, or MLA's latent c̃,
    which plays V) or ``"key"`` (post-RoPE K, or MLA's k_pe)."""
    tensors = run.kv_caches[layer_idx]
    slots = run.slots(positions)
    rope = run.model.attention_layers()[layer_idx].latent_rope_dim
    if rope is None:
        cache = tensors[1] if which == "value" else tensors[0]
        return cache.view(-1, *cache.shape[2:])[slots].clone()
    rows = tensors[0].view(-1, tensors[0].shape[-1])[slots]
    return (rows[:, :-rope] if which == "value" else rows[:, -rope:]).clone()

"""The combine prefill's shared machinery: place cached segment KV at its new positions, then run the
blended forward (spec Part B) over a chosen set of rows F.

Legend: N = prompt tokens, F = recomputed rows (sorted positions), S = page size, Hd = hidden size.

``CombineRun`` is everything a backend needs about one request: its tokens, its layout, its pages (already
holding the exact prefix and the re-rotated reused KV) and the model. ``blended_forward`` runs the model's layer
loop (``CausalLM.run_layers``) on the rows F only: fresh K/V of F overwrite the placed ones, and row i attends to
every context key j <= position(i) (the exact partial-causal mask). At check layers a ``RowSelection`` may shrink F.
``blended_forward_many`` runs the combines of several requests as one forward, each request a sequence of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F
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
        return combine_context([self], [rows], recording)

    def is_suffix(self, rows: torch.Tensor) -> bool:
        """``rows`` (sorted, distinct) are the prompt's last ``len(rows)`` positions: an ordinary prefill chunk."""
        count = rows.numel()
        return count > 0 and int(rows[0]) == self.layout.num_tokens - count

    def positions(self, positions: Sequence[int]) -> torch.Tensor:
        return torch.tensor(positions, dtype=torch.int64, device=self.token_ids.device)


def combine_context(runs: Sequence[CombineRun], rows: Sequence[torch.Tensor],
                    recording: bool = False) -> AttentionContext:
    """Attention for the rows ``rows[i]`` (sorted positions) of each request ``runs[i]``, side by side in one
    batch: each request is a sequence of its own, attending only to its own pages. The runs share the model and
    its caches."""
    starts = [0]
    for part in rows:
        starts.append(starts[-1] + part.numel())
    # suffixes are ordinary prefill chunks: the backend's causal path, no per-row mask to build
    suffixes = all(run.is_suffix(part) for run, part in zip(runs, rows))
    widest = max(run.block_table.numel() for run in runs)
    tables = torch.stack([F.pad(run.block_table, (0, widest - run.block_table.numel())) for run in runs])
    meta = AttentionMetadata(query_start_loc=starts, seq_lens=[run.layout.num_tokens for run in runs],
                             block_tables=tables, slot_mapping=torch.cat([run.slots(p) for run, p in zip(runs, rows)]),
                             page_size=runs[0].page_size, query_positions=None if suffixes else torch.cat(list(rows)))
    cls = RecordingAttentionContext if recording else AttentionContext
    return cls(runs[0].attention_backend, meta, runs[0].kv_caches, runs[0].mla_backend)


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
               recorded: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Indices into ``rows`` to keep (sorted); must keep every fresh row. ``recorded``: what the check layer's
        attention was given for ``rows`` (``RecordingAttentionContext.recorded``)."""


def blended_forward(run: CombineRun, rows: torch.Tensor, selection: RowSelection | None = None) -> CombineResult:
    """Decoder layers on rows F only (attention-only models); returns the last token's hidden state."""
    return blended_forward_many([run], [rows], selection)[0]


def blended_forward_many(runs: Sequence[CombineRun], rows: Sequence[torch.Tensor],
                         selection: RowSelection | None = None) -> list[CombineResult]:
    """``blended_forward`` of several requests in one forward: their rows side by side (``combine_context``), so
    each layer runs one matmul per weight for all of them. A check layer selects each request's rows apart."""
    hook = None if selection is None else _SelectAtCheckLayers(runs, selection, [part.numel() for part in rows])
    token_ids = torch.cat([run.token_ids[part] for run, part in zip(runs, rows)])
    out = runs[0].model.run_layers(token_ids, torch.cat(list(rows)), combine_context(runs, rows), hook)
    counts = [part.numel() for part in rows] if hook is None else hook.counts
    results, end = [], 0
    for run, count in zip(runs, counts):  # every request keeps its last token, the last of its rows
        start, end = end, end + count
        results.append(CombineResult(out.hidden[end - 1:end], run.layout.count_reused(out.positions[start:end].tolist())))
    return results


class _SelectAtCheckLayers:
    """Layer hook: a check layer runs with a recording context, then only the rows ``selection`` keeps go on.
    ``counts``: how many of the batch's rows belong to each request, in order (updated at each check layer)."""

    def __init__(self, runs: Sequence[CombineRun], selection: RowSelection, counts: list[int]):
        self.runs, self.selection, self.counts = runs, selection, counts

    def _split(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return list(rows.split(self.counts))

    def __call__(self, layer_idx: int, layer: nn.Module, rows: LayerRows) -> LayerRows:
        if layer_idx not in self.selection.check_layers:
            return rows._replace(hidden=layer(*rows))
        parts = self._split(rows.positions)
        befores = [self.selection.before(layer_idx, run, part) for run, part in zip(self.runs, parts)]
        ctx = combine_context(self.runs, parts, recording=True)
        hidden = layer(rows.positions, rows.hidden, ctx)
        keep, start = [], 0
        for run, part, before in zip(self.runs, parts, befores):
            recorded = {name: value[start:start + part.numel()] for name, value in ctx.recorded.items()}
            keep.append(self.selection.select(layer_idx, run, part, before, recorded) + start)
            start += part.numel()
        self.counts = [part.numel() for part in keep]
        keep = torch.cat(keep)
        positions = rows.positions[keep]
        return LayerRows(positions, hidden[keep], combine_context(self.runs, self._split(positions)))


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

"""The PIC backend interface: everything algorithm-specific about reusing a segment at a new position.

The engine and the cluster only ever see this interface:
- ``cache_format``: segments prefilled the same way share store entries (part of the store key);
- ``prefill_segment``: compute one segment alone into pages, returning the extra state to cache with it;
- ``combine``: the combine prefill of one request whose reused KV is already placed (``CombineRun``);
- ``combine_cost``: the planner's estimate of that combine, in prefill-token units.

Every backend states ``exact_settings``: the options under which it must equal plain prefill (the tests check).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Mapping

import torch
from torch import nn

from nebula_engine.kernels.attention import AttentionBackend, AttentionContext, AttentionMetadata
from nebula_engine.kernels.mla_attention import MLAAttentionBackend
from nebula_engine.pic.combine import CombineResult, CombineRun
from nebula_engine.pic.layout import CombineLayout


class UnsupportedModelError(ValueError):
    """This backend cannot serve this model (e.g. token-sparse recompute on linear-attention layers)."""


def has_linear_attention(model: nn.Module) -> bool:
    return model.num_linear_layers > 0


@dataclass(frozen=True)
class SegmentPrefill:
    """Where one segment's prefill writes: its own pages, plus scratch slots for the context computed before it.

    ``context_ids`` are prepended and their K/V dropped: a BOS (CacheBlend's and EPIC's offline encoding), or the
    request's whole prefix (a backend with ``context="prefix"``), so the segment's K/V is computed behind a real
    attention sink at the positions it takes right after that prefix."""

    token_ids: torch.Tensor  # [n] int64
    pages: tuple[int, ...]
    page_size: int
    kv_caches: Any  # per attention layer, the pool's tensors
    attention_backend: AttentionBackend
    mla_backend: MLAAttentionBackend | None
    context_ids: tuple[int, ...] = ()  # prefilled before the segment, K/V discarded
    scratch_slots: tuple[int, ...] = ()  # one per context token: where its K/V goes

    def __post_init__(self) -> None:
        if len(self.scratch_slots) != len(self.context_ids):
            raise ValueError(f"{len(self.context_ids)} context tokens need as many scratch slots, "
                             f"got {len(self.scratch_slots)}")

    def slots(self) -> torch.Tensor:
        index = torch.arange(self.token_ids.numel(), device=self.token_ids.device)
        pages = torch.tensor(self.pages, dtype=torch.int64, device=index.device)
        return pages[index // self.page_size] * self.page_size + index % self.page_size

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """(input ids, positions, attention context) of the segment's prefill; K/V land in ``pages``."""
        ids, slots = self.token_ids, self.slots()
        if self.context_ids:
            ids = torch.cat([ids.new_tensor(self.context_ids), ids])
            slots = torch.cat([slots.new_tensor(self.scratch_slots), slots])
        positions = torch.arange(ids.numel(), device=ids.device)
        # a wholly new sequence attends to its own fresh K/V: the pages are only written, never read
        meta = AttentionMetadata(query_start_loc=[0, ids.numel()], seq_lens=[ids.numel()], block_tables=None,
                                 slot_mapping=slots, page_size=self.page_size)
        return ids, positions, AttentionContext(self.attention_backend, meta, self.kv_caches, self.mla_backend)

    @property
    def position_offset(self) -> int:
        return len(self.context_ids)


SEGMENT_CONTEXTS = ("alone", "prefix")


@dataclass(frozen=True)
class PICBackend(ABC):
    """Subclasses are frozen dataclasses whose fields are the algorithm's options.

    ``context`` (every backend): what a segment is prefilled behind when it is cached. ``alone``: nothing (or the
    model's BOS); ``prefix``: the request's tokens before its first PIC segment (system prompt, chat header), so
    the cached K/V carries that prefix's attention sink and its positions; such entries are keyed by the prefix
    too (``PICExecutor.segment_key``), and a request behind another prefix prefills its own."""

    name: ClassVar[str]
    context: str = "alone"
    handles_linear_attention: ClassVar[bool] = False
    exact_settings: ClassVar[Mapping[str, Any]] = {}  # options under which combine == plain prefill

    def __post_init__(self) -> None:
        if self.context not in SEGMENT_CONTEXTS:
            raise ValueError(f"{self.name}: context must be one of {', '.join(SEGMENT_CONTEXTS)}, "
                             f"got {self.context!r}")

    @property
    def spec(self) -> str:
        """``name:option=value,...``: parses back to an equal backend with ``get_pic_backend`` (``context`` only
        when it is not the default ``alone``, so older specs and store manifests read the same)."""
        options = ",".join(f"{f.name}={_format(getattr(self, f.name))}" for f in fields(self)
                           if not (f.name == "context" and self.context == "alone"))
        return f"{self.name}:{options}" if options else self.name

    @property
    def cache_format(self) -> str:
        """Backends whose segment entries are computed identically share them (``segment_key``'s backend part)."""
        return "alone"

    def check_model(self, model: nn.Module) -> None:
        if has_linear_attention(model) and self.context != "alone":
            raise UnsupportedModelError(f"PIC backend {self.name!r}: context={self.context} is for attention-only "
                                        f"models; {type(model).__name__} has linear-attention layers")
        if has_linear_attention(model) and not self.handles_linear_attention:
            raise UnsupportedModelError(
                f"PIC backend {self.name!r} does not support models with linear-attention layers "
                f"({type(model).__name__}): a recomputed token would need the recurrent state at its own position; "
                f"use 'hypic'")

    def prefill_segment(self, model: nn.Module, prefill: SegmentPrefill) -> dict[str, Any]:
        """Compute the segment alone, its K/V written into ``prefill.pages``; returns the state to cache."""
        return self.prefill_segments(model, [prefill])[0]

    def prefill_segments(self, model: nn.Module, prefills: list[SegmentPrefill]) -> list[dict[str, Any]]:
        """Each segment alone, all in one forward: a varlen batch in which every segment is its own sequence."""
        if has_linear_attention(model):  # per-sequence states: one at a time
            states = []
            for prefill in prefills:
                ids, positions, ctx = prefill.inputs()
                model.forward(ids, positions, ctx)
                states.append({"position_offset": prefill.position_offset})
            return states
        parts = [prefill.inputs() for prefill in prefills]
        starts = [0]
        for ids, _, _ in parts:
            starts.append(starts[-1] + ids.numel())
        meta = AttentionMetadata(query_start_loc=starts, seq_lens=[ids.numel() for ids, _, _ in parts],
                                 block_tables=None, slot_mapping=torch.cat([c.meta.slot_mapping for _, _, c in parts]),
                                 page_size=prefills[0].page_size)
        ctx = AttentionContext(prefills[0].attention_backend, meta, prefills[0].kv_caches, prefills[0].mla_backend)
        model.forward(torch.cat([ids for ids, _, _ in parts]), torch.cat([pos for _, pos, _ in parts]), ctx)
        return [{"position_offset": prefill.position_offset} for prefill in prefills]

    @abstractmethod
    def combine(self, run: CombineRun) -> CombineResult:
        """Fill the request's remaining K/V (placed reused KV included) and return the last token's hidden state."""

    def combine_many(self, runs: list[CombineRun]) -> list[CombineResult]:
        """``combine`` of each run (requests of one engine step, one model and pool). Backends whose combine is one
        blended forward run them as one batch (``blended_forward_many``); this default runs them one by one."""
        return [self.combine(run) for run in runs]

    @abstractmethod
    def combine_cost(self, layout: CombineLayout, num_layers: int) -> float:
        """Estimated combine time in prefill-token units (tokens recomputed through every layer)."""


def _format(value: Any) -> str:
    if isinstance(value, tuple):
        return "/".join(str(v) for v in value)
    return str(value)

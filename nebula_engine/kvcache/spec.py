"""What the KV pool stores per page, one spec per kind of layer (vLLM v1 KV cache groups).

Page accounting is shared by every paged group: page ``p`` of a sequence's block table indexes the same
page id in each group's storage. Each group owns its own tensors, shaped by its spec.

Kinds: full attention (K/V per token), MLA latent (c̃ + rotated k_pe per token), both paged; and linear
attention (``LinearStateSpec``), whose state has constant size per sequence and so lives in per-sequence
*state slots* rather than pages. A group's ``layer_indices`` count layers of its own kind: attention layers
index ``AttentionContext.kv_caches``, linear layers index the storage's ``linear_states``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class KVCacheSpec(ABC):
    """Per-layer storage of one layer type."""

    dtype: torch.dtype

    @abstractmethod
    def page_bytes(self, page_size: int) -> int:
        """Bytes one page of one layer occupies."""

    @abstractmethod
    def allocate(self, num_pages: int, page_size: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """Tensors of one layer for ``num_pages`` pages."""


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype = torch.float32

    def page_bytes(self, page_size: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return page_size * self.num_kv_heads * (self.head_dim + self.v_head_dim) * elem

    def allocate(self, num_pages, page_size, device):
        # empty, not zeros: a slot is always written before any query reads it
        k = torch.empty(num_pages, page_size, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=device)
        v = torch.empty(num_pages, page_size, self.num_kv_heads, self.v_head_dim, dtype=self.dtype, device=device)
        return k, v


@dataclass(frozen=True)
class MLALatentSpec(KVCacheSpec):
    """One tensor per layer [P, S, R + Dr]: each token's normed latent c̃ [R], then its rotated k_pe [Dr]."""

    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype = torch.float32

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def page_bytes(self, page_size: int) -> int:
        return page_size * self.width * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_pages, page_size, device):
        return (torch.empty(num_pages, page_size, self.width, dtype=self.dtype, device=device),)


@dataclass(frozen=True)
class LinearStateSpec:
    """Per-sequence state of one linear-attention layer, held in slots: conv [slots, C, K-1] in the model
    dtype and recurrent [slots, Hv, dk, dv] in fp32 (errors compound over the whole context otherwise)."""

    conv_channels: int
    conv_width: int  # K-1: the conv inputs carried over
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    dtype: torch.dtype = torch.float32

    def slot_bytes(self) -> int:
        conv = self.conv_channels * self.conv_width * torch.empty((), dtype=self.dtype).element_size()
        return conv + self.num_heads * self.head_k_dim * self.head_v_dim * 4

    def allocate(self, num_slots: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        # empty: a slot's state is only read after the sequence owning it wrote it (fresh sequences start from None)
        conv = torch.empty(num_slots, self.conv_channels, self.conv_width, dtype=self.dtype, device=device)
        recurrent = torch.empty(num_slots, self.num_heads, self.head_k_dim, self.head_v_dim, dtype=torch.float32,
                                device=device)
        return conv, recurrent


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one spec; ``layer_indices`` index the layers of the spec's kind (see module doc)."""

    layer_indices: tuple[int, ...]
    spec: KVCacheSpec | LinearStateSpec

    @property
    def is_paged(self) -> bool:
        return isinstance(self.spec, KVCacheSpec)


def full_attention_groups(shapes: list[tuple[int, int, int]], dtype: torch.dtype) -> list[KVCacheGroupSpec]:
    """Group attention layers by (num_kv_heads, head_dim, v_head_dim), keeping first-seen order."""
    layers: dict[tuple[int, int, int], list[int]] = {}
    for index, shape in enumerate(shapes):
        layers.setdefault(tuple(shape), []).append(index)
    return [KVCacheGroupSpec(tuple(idx), FullAttentionSpec(*shape, dtype=dtype)) for shape, idx in layers.items()]


def bytes_per_page(groups: list[KVCacheGroupSpec], page_size: int) -> int:
    return sum(len(g.layer_indices) * g.spec.page_bytes(page_size) for g in groups if g.is_paged)


def bytes_per_state_slot(groups: list[KVCacheGroupSpec]) -> int:
    """Bytes of one sequence's linear-attention state over all layers; 0 for models without any."""
    return sum(len(g.layer_indices) * g.spec.slot_bytes() for g in groups if not g.is_paged)

"""What the KV pool stores per page, one spec per kind of layer (vLLM v1 KV cache groups).

Page accounting is shared by every group: page ``p`` of a sequence's block table indexes the same
page id in each group's storage. Each group owns its own tensors, shaped by its spec.
Later kinds (MLA latent, linear-attention state) add a spec class here; the pool does not change.
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
class KVCacheGroupSpec:
    """Layers that share one spec; ``layer_indices`` index the model's attention layers."""

    layer_indices: tuple[int, ...]
    spec: KVCacheSpec


def full_attention_groups(shapes: list[tuple[int, int, int]], dtype: torch.dtype) -> list[KVCacheGroupSpec]:
    """Group attention layers by (num_kv_heads, head_dim, v_head_dim), keeping first-seen order."""
    layers: dict[tuple[int, int, int], list[int]] = {}
    for index, shape in enumerate(shapes):
        layers.setdefault(tuple(shape), []).append(index)
    return [KVCacheGroupSpec(tuple(idx), FullAttentionSpec(*shape, dtype=dtype)) for shape, idx in layers.items()]


def bytes_per_page(groups: list[KVCacheGroupSpec], page_size: int) -> int:
    return sum(len(g.layer_indices) * g.spec.page_bytes(page_size) for g in groups)

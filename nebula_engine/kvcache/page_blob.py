"""Tensors kept in the pool's own pages: cached linear-attention states and HYPIC transition states.

One page is ``bytes_per_page`` bytes of memory over every paged layer (one slice of each layer's K/V tensors).
A blob of tensors is written as raw bytes across those slices, page after page, so a cached state draws on the
same byte budget as K/V, is evicted with the entry that holds its pages, and moves through the tiers as pages do
(vLLM v1 likewise keeps a hybrid model's Mamba states in KV-cache pages rather than beside them).

``pack_tensors`` / ``unpack_tensors`` turn a backend's state mapping into (a skeleton without tensors, the
tensors) and back, so only the tensors take pages and the skeleton stays a small Python value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nebula_engine.kvcache.pool import KVCacheError, KVCacheStorage
from nebula_engine.kvcache.spec import bytes_per_page


@dataclass(frozen=True)
class TensorLayout:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorLayout:
        return cls(tuple(tensor.shape), tensor.dtype)

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


def blob_bytes(layouts: list[TensorLayout]) -> int:
    return sum(layout.nbytes for layout in layouts)


class PageBlobIO:
    """Writes tensors into pages of a ``KVCacheStorage`` and reads them back."""

    def __init__(self, storage: KVCacheStorage):
        self.storage = storage
        self.page_bytes = bytes_per_page(storage.groups, storage.page_size)
        if self.page_bytes <= 0:
            raise KVCacheError("a model without paged layers has no pages to keep states in")

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes)

    def _page_views(self, pages: list[int]) -> list[torch.Tensor]:
        """Each page's memory, as uint8 views of its slice of every paged tensor, in a fixed order."""
        tensors = [t for layer in self.storage.layer_caches for t in layer]
        return [t[page].view(torch.uint8).reshape(-1) for page in pages for t in tensors]

    def write(self, pages: list[int], tensors: list[torch.Tensor]) -> None:
        """Store ``tensors`` (any dtypes and shapes) in ``pages``; KVCacheError if they do not fit."""
        device = self.storage.layer_caches[0][0].device
        blob = (torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8).to(device) for t in tensors])
                if tensors else torch.empty(0, dtype=torch.uint8, device=device))
        if blob.numel() > len(pages) * self.page_bytes:
            raise KVCacheError(f"{blob.numel()} bytes of state do not fit in {len(pages)} pages "
                               f"of {self.page_bytes} bytes")
        offset = 0
        for view in self._page_views(pages):
            if offset >= blob.numel():
                break
            count = min(view.numel(), blob.numel() - offset)
            view[:count].copy_(blob[offset:offset + count])
            offset += count

    def read(self, pages: list[int], layouts: list[TensorLayout]) -> list[torch.Tensor]:
        """Fresh tensors of ``layouts`` from what ``write`` stored in ``pages``."""
        total = blob_bytes(layouts)
        chunks, gathered = [], 0
        for view in self._page_views(pages):
            if gathered >= total:
                break
            chunks.append(view[:total - gathered])
            gathered += chunks[-1].numel()
        if gathered < total:
            raise KVCacheError(f"{len(pages)} pages hold fewer than the {total} bytes asked for")
        blob = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
        out, offset = [], 0
        for layout in layouts:
            # clone: a fresh, aligned buffer for the dtype view
            part = blob[offset:offset + layout.nbytes].clone()
            out.append(part.view(layout.dtype).reshape(layout.shape))
            offset += layout.nbytes
        return out


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor of a packed state went: its index in the packed list."""

    index: int


def pack_tensors(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """(``value`` with every tensor replaced by a ``TensorRef``, the tensors in order); dicts, lists and tuples
    are walked, anything else is kept as it is."""
    tensors: list[torch.Tensor] = []

    def walk(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            tensors.append(item)
            return TensorRef(len(tensors) - 1)
        if isinstance(item, dict):
            return {k: walk(v) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return type(item)(walk(v) for v in item)
        return item

    return walk(value), tensors


def unpack_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of ``pack_tensors``."""
    if isinstance(skeleton, TensorRef):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: unpack_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(unpack_tensors(v, tensors) for v in skeleton)
    return skeleton


class LinearStateIO:
    """A sequence's linear-attention state (every layer's conv and recurrent slot) to and from pool pages."""

    def __init__(self, blob: PageBlobIO, linear_states: list[tuple[torch.Tensor, torch.Tensor]]):
        self.blob = blob
        self.linear_states = linear_states
        self.layouts = [TensorLayout.of(t[0]) for pair in linear_states for t in pair]
        self.num_pages = blob.pages_for(blob_bytes(self.layouts))  # pages one state takes

    def save(self, slot: int, pages: list[int]) -> None:
        self.blob.write(pages, [t[slot] for pair in self.linear_states for t in pair])

    def load(self, pages: list[int], slot: int) -> None:
        values = self.blob.read(pages, self.layouts)
        for tensor, value in zip((t for pair in self.linear_states for t in pair), values, strict=True):
            tensor[slot].copy_(value)

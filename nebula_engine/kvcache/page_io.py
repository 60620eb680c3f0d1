"""Copying page contents out of and back into the device pool, for the lower cache tiers.

The cache bookkeeping only names pages; ``PageIO`` is the one place that touches their tensors.
A read returns private host copies (safe to keep after the pages are reused); a write fills
freshly allocated pages before any query reads them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from nebula_engine.kvcache.pool import KVCacheStorage


class PageIO(Protocol):
    def read_pages(self, pages: list[int]) -> list[torch.Tensor]:
        """Host copies of ``pages`` in every cached tensor, each [len(pages), ...]."""

    def write_pages(self, pages: list[int], data: list[torch.Tensor]) -> None:
        """Write what ``read_pages`` returned into ``pages``."""


class StoragePageIO:
    def __init__(self, storage: KVCacheStorage):
        self.storage = storage

    def _tensors(self) -> list[torch.Tensor]:
        return [t for tensors in self.storage.layer_caches for t in tensors]

    def read_pages(self, pages: list[int]) -> list[torch.Tensor]:
        tensors = self._tensors()
        index = torch.tensor(pages, device=tensors[0].device)
        return [t.index_select(0, index).to("cpu", copy=True) for t in tensors]

    def write_pages(self, pages: list[int], data: list[torch.Tensor]) -> None:
        tensors = self._tensors()
        index = torch.tensor(pages, device=tensors[0].device)
        for t, d in zip(tensors, data, strict=True):
            t.index_copy_(0, index, d.to(t.device, t.dtype))

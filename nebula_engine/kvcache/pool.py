"""Paged KV pool: page accounting, per-sequence block tables, and the per-group tensor storage.

``PagePool`` and ``KVCacheManager`` are pure bookkeeping (the scheduler's side); ``KVCacheStorage``
holds the tensors (the model runner's side). Both sides agree only on page ids.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from nebula_engine.kvcache.spec import KVCacheGroupSpec, bytes_per_page


class KVCacheError(RuntimeError):
    """Misuse of the pool: double free, unknown sequence."""


class OutOfPagesError(KVCacheError):
    """Not enough free pages; the scheduler reacts by preempting or waiting."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"need {needed} free KV pages, only {free} left")
        self.needed = needed
        self.free = free


class PagePool:
    """Fixed set of page ids with a FIFO free list and a ref count per page."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.ref_cnt = [0] * num_pages
        self._free = deque(range(num_pages))

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages with ref count 1; all or nothing."""
        if n > len(self._free):
            raise OutOfPagesError(n, len(self._free))
        pages = [self._free.popleft() for _ in range(n)]
        for page in pages:
            self.ref_cnt[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for page in pages:
            if self.ref_cnt[page] <= 0:
                raise KVCacheError(f"cannot share page {page}: it is free")
        for page in pages:
            self.ref_cnt[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page returns to the free list at zero."""
        for page in pages:
            if self.ref_cnt[page] <= 0:
                raise KVCacheError(f"double free of page {page}")
            self.ref_cnt[page] -= 1
            if self.ref_cnt[page] == 0:
                self._free.append(page)


@dataclass(frozen=True)
class PageCopy:
    """Copy one page's contents in every group (copy-on-write of a shared partial page)."""

    src: int
    dst: int


class KVCacheManager:
    """Block tables per sequence on top of a ``PagePool``."""

    def __init__(self, num_pages: int, page_size: int):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def num_new_pages(self, seq_id: str, num_tokens: int) -> int:
        """Pages still to allocate so ``seq_id`` can hold ``num_tokens`` tokens."""
        return max(0, self.pages_for(num_tokens) - len(self.block_tables.get(seq_id, ())))

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.num_new_pages(seq_id, num_tokens) <= self.pool.num_free_pages

    def allocate_slots(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s block table to hold ``num_tokens`` tokens; returns the new pages.

        Raises ``OutOfPagesError`` without changing anything when the pool is short.
        """
        new_pages = self.pool.allocate(self.num_new_pages(seq_id, num_tokens))
        self.block_tables.setdefault(seq_id, []).extend(new_pages)
        return new_pages

    def free(self, seq_id: str) -> None:
        if seq_id not in self.block_tables:
            raise KVCacheError(f"sequence {seq_id!r} holds no pages (already freed?)")
        # release newest first so a re-allocation reuses the tail pages last
        self.pool.release(self.block_tables.pop(seq_id)[::-1])

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[PageCopy]:
        """Give ``child_id`` the first ``num_tokens`` tokens of ``parent_id``.

        Full pages are shared (ref count + 1); a partially filled last page gets a private copy
        because both sequences will append into it. Returns the page copies the runner must apply.
        """
        if child_id in self.block_tables:
            raise KVCacheError(f"sequence {child_id!r} already has a block table")
        parent = self.block_tables[parent_id][: self.pages_for(num_tokens)]
        num_full = num_tokens // self.page_size
        tail = self.pool.allocate(len(parent) - num_full)
        self.pool.share(parent[:num_full])
        copies = [PageCopy(src, dst) for src, dst in zip(parent[num_full:], tail)]
        self.block_tables[child_id] = parent[:num_full] + tail
        return copies


def num_pages_for_budget(groups: list[KVCacheGroupSpec], page_size: int, budget_bytes: int) -> int:
    num_pages = budget_bytes // bytes_per_page(groups, page_size)
    if num_pages <= 0:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes is smaller than one page "
                         f"({bytes_per_page(groups, page_size)} bytes)")
    return num_pages


class KVCacheStorage:
    """The pool's tensors: for each attention layer, the tensors its group's spec allocates."""

    def __init__(self, groups: list[KVCacheGroupSpec], num_pages: int, page_size: int,
                 device: torch.device | str):
        num_layers = sum(len(g.layer_indices) for g in groups)
        layers: list[tuple[torch.Tensor, ...] | None] = [None] * num_layers
        for group in groups:
            for index in group.layer_indices:
                layers[index] = group.spec.allocate(num_pages, page_size, device)
        self.layer_caches: list[tuple[torch.Tensor, ...]] = layers
        self.num_pages = num_pages
        self.page_size = page_size

    def copy_pages(self, copies: list[PageCopy]) -> None:
        if not copies:
            return
        src = torch.tensor([c.src for c in copies], device=self.layer_caches[0][0].device)
        dst = torch.tensor([c.dst for c in copies], device=src.device)
        for tensors in self.layer_caches:
            for t in tensors:
                t.index_copy_(0, dst, t.index_select(0, src))

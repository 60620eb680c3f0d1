"""Paged KV pool: page accounting, per-sequence block tables, and the per-group tensor storage.

``PagePool`` and ``KVCacheManager`` are pure bookkeeping (the scheduler's side); ``KVCacheStorage``
holds the tensors (the model runner's side). Both sides agree only on page ids and state-slot ids.
Models with linear-attention layers also need one state slot per running sequence: it is taken when the
sequence first gets pages and given back with them (finish or preemption).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Mapping

import torch

from nebula_engine.kvcache.spec import KVCacheGroupSpec, bytes_per_page, bytes_per_state_slot


class KVCacheError(RuntimeError):
    """Misuse of the pool: double free, unknown sequence."""


class OutOfPagesError(KVCacheError):
    """Not enough free pages; the scheduler reacts by preempting or waiting."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"need {needed} free KV pages, only {free} left")
        self.needed = needed
        self.free = free


class PagePool:
    """Fixed set of page ids with a ref count per page; the lowest free ids are handed out first.

    Lowest-first (a min-heap) keeps a new sequence's pages consecutive whenever the pool is not
    fragmented, and attention reads consecutive pages in place rather than gathering them.
    """

    def __init__(self, num_pages: int, reclaimer: Callable[[int], int] | None = None):
        """``reclaimer``: called with the shortfall before ``allocate`` gives up, to free cached pages (the
        ``CacheStore`` that owns this pool passes its ``evict``)."""
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.ref_cnt = [0] * num_pages
        self._free = list(range(num_pages))  # a sorted list is a valid min-heap
        self.reclaimer = reclaimer

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages with ref count 1; all or nothing."""
        if n > len(self._free) and self.reclaimer is not None:
            self.reclaimer(n - len(self._free))
        if n > len(self._free):
            raise OutOfPagesError(n, len(self._free))
        pages = [heapq.heappop(self._free) for _ in range(n)]
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
                heapq.heappush(self._free, page)


class OutOfStateSlotsError(KVCacheError):
    """Every linear-attention state slot is held by a running sequence; admission has to wait."""

    def __init__(self, num_slots: int):
        super().__init__(f"all {num_slots} linear-attention state slots are in use")


class StateSlotPool:
    """Per-sequence state slots (linear-attention layers): at most one per sequence."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: dict[str, int] = {}
        self._free = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_hold(self, seq_id: str) -> bool:
        return seq_id in self.slot_of or bool(self._free)

    def acquire(self, seq_id: str) -> int:
        if seq_id not in self.slot_of:
            if not self._free:
                raise OutOfStateSlotsError(self.num_slots)
            self.slot_of[seq_id] = self._free.popleft()
        return self.slot_of[seq_id]

    def release(self, seq_id: str) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)


class KVCacheManager:
    """Block tables per sequence on top of a ``PagePool``."""

    def __init__(self, pool: PagePool, page_size: int, num_state_slots: int = 0):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.pool = pool
        self.block_tables: dict[str, list[int]] = {}
        self.state_slots = StateSlotPool(num_state_slots) if num_state_slots else None

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def num_new_pages(self, seq_id: str, num_tokens: int) -> int:
        """Pages still to allocate so ``seq_id`` can hold ``num_tokens`` tokens."""
        return max(0, self.pages_for(num_tokens) - len(self.block_tables.get(seq_id, ())))

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Pages for ``num_tokens`` tokens and, with linear-attention layers, a state slot are available."""
        if self.state_slots is not None and not self.state_slots.can_hold(seq_id):
            return False
        return self.num_new_pages(seq_id, num_tokens) <= self.num_free_pages

    def state_checkpoint(self, seq_id: str) -> int:
        """Tokens at which ``seq_id``'s prefill must end a step, so its linear-attention state there can be cached
        (``PrefixCachingKVCacheManager``); 0: nowhere."""
        return 0

    def state_slot(self, seq_id: str) -> int | None:
        """``seq_id``'s linear-attention state slot; None for models without linear-attention layers."""
        return None if self.state_slots is None else self.state_slots.slot_of[seq_id]

    def allocate_slots(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s block table to hold ``num_tokens`` tokens; returns the new pages.

        Raises ``OutOfPagesError`` / ``OutOfStateSlotsError`` without changing anything when the pool is short.
        """
        if self.state_slots is not None and not self.state_slots.can_hold(seq_id):
            raise OutOfStateSlotsError(self.state_slots.num_slots)
        new_pages = self.pool.allocate(self.num_new_pages(seq_id, num_tokens))
        if self.state_slots is not None:
            self.state_slots.acquire(seq_id)
        self.block_tables.setdefault(seq_id, []).extend(new_pages)
        return new_pages

    def free(self, seq_id: str) -> None:
        if seq_id not in self.block_tables:
            raise KVCacheError(f"sequence {seq_id!r} holds no pages (already freed?)")
        self.pool.release(self.block_tables.pop(seq_id))
        if self.state_slots is not None:
            self.state_slots.release(seq_id)


def num_pages_for_budget(groups: list[KVCacheGroupSpec], page_size: int, budget_bytes: int,
                         num_state_slots: int = 0) -> int:
    """Pages that fit in ``budget_bytes`` after ``num_state_slots`` linear-attention state slots."""
    num_pages = (budget_bytes - num_state_slots * bytes_per_state_slot(groups)) // bytes_per_page(groups, page_size)
    if num_pages <= 0:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes is smaller than one page "
                         f"({bytes_per_page(groups, page_size)} bytes)")
    return num_pages


class KVCacheStorage:
    """The pool's tensors: for each attention layer, the tensors its group's spec allocates; for each
    linear-attention layer, its state slots (conv [slots, C, K-1], recurrent [slots, Hv, dk, dv])."""

    def __init__(self, groups: list[KVCacheGroupSpec], num_pages: int, page_size: int,
                 device: torch.device | str, num_state_slots: int = 0):
        paged = [g for g in groups if g.is_paged]
        layers: list[tuple[torch.Tensor, ...] | None] = [None] * sum(len(g.layer_indices) for g in paged)
        for group in paged:
            for index in group.layer_indices:
                layers[index] = group.spec.allocate(num_pages, page_size, device)
        self.layer_caches: list[tuple[torch.Tensor, ...]] = layers
        self.groups = list(groups)
        stateful = [g for g in groups if not g.is_paged]
        states: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * sum(len(g.layer_indices) for g in stateful)
        for group in stateful:
            for index in group.layer_indices:
                states[index] = group.spec.allocate(num_state_slots, device)
        self.linear_states: list[tuple[torch.Tensor, torch.Tensor]] = states
        self.num_pages = num_pages
        self.page_size = page_size

    def linear_state(self, slot: int) -> dict[str, list[torch.Tensor]]:
        """A CPU copy of state slot ``slot``: every linear-attention layer's conv and recurrent state, what a
        sequence continues from. Empty for models without linear-attention layers."""
        if not self.linear_states:
            return {}
        return {"conv": [conv[slot].to("cpu", copy=True) for conv, _ in self.linear_states],
                "recurrent": [recurrent[slot].to("cpu", copy=True) for _, recurrent in self.linear_states]}

    def load_linear_state(self, slot: int, state: Mapping[str, list[torch.Tensor]]) -> None:
        """Write ``state`` (``linear_state`` of this or another engine of the same model) into slot ``slot``;
        ValueError, changing nothing, when it does not fit this model's layers."""
        pairs = list(zip(state.get("conv", ()), state.get("recurrent", ())))
        targets = [t[slot] for pair in self.linear_states for t in pair]
        values = [t for pair in pairs for t in pair]
        if len(pairs) != len(self.linear_states) or any(
                not isinstance(v, torch.Tensor) or v.shape != t.shape for v, t in zip(values, targets)):
            raise ValueError("the linear-attention state does not fit this model's layers")
        for target, value in zip(targets, values):
            target.copy_(value)

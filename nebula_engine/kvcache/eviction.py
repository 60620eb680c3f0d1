"""Which cache type gives up pages when PC and PIC share one pool (paper §6, §6.1).

``soft-share`` (eq. 2): with target PC share ``p``, evict PC first if PC occupancy exceeds
p * (PC + PIC), else PIC. ``unified-lru`` evicts whichever type holds the least recently used
evictable entry. ``fixed-partition`` gives PC a hard ``p`` of the capacity and PIC the rest.
LRU inside each type is the stores' job; a policy only picks the type. Changing ``pc_share`` at run
time evicts nothing by itself: it steers the next evictions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from nebula_engine.kvcache.events import CacheKind


@dataclass(frozen=True)
class CacheState:
    """Device occupancy of both types when an eviction is decided."""

    pc_tokens: int
    pic_tokens: int
    capacity_tokens: int
    oldest_pc: int | None  # last_access of the next PC victim; None when no PC entry is evictable
    oldest_pic: int | None

    def tokens(self, kind: CacheKind) -> int:
        return self.pc_tokens if kind is CacheKind.PC else self.pic_tokens

    def evictable(self, kind: CacheKind) -> bool:
        return (self.oldest_pc if kind is CacheKind.PC else self.oldest_pic) is not None


def _other(kind: CacheKind) -> CacheKind:
    return CacheKind.PIC if kind is CacheKind.PC else CacheKind.PC


class EvictionPolicy(ABC):
    name: str

    def __init__(self, pc_share: float = 0.5):
        self.pc_share = pc_share

    @property
    def pc_share(self) -> float:
        return self._pc_share

    @pc_share.setter
    def pc_share(self, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"pc_share must be in [0, 1], got {value}")
        self._pc_share = value

    def victim_kind(self, state: CacheState) -> CacheKind | None:
        """The type to evict from next; falls back to the other type when the preferred one has
        nothing evictable; None when neither has."""
        preferred = self.preferred_kind(state)
        for kind in (preferred, _other(preferred)):
            if state.evictable(kind):
                return kind
        return None

    @abstractmethod
    def preferred_kind(self, state: CacheState) -> CacheKind:
        """The type this policy evicts first under pool pressure."""

    def over_quota(self, kind: CacheKind, state: CacheState) -> bool:
        """Whether ``kind`` must shrink right after an insert even without pool pressure."""
        return False


class SoftShare(EvictionPolicy):
    name = "soft-share"

    def preferred_kind(self, state: CacheState) -> CacheKind:
        over = state.pc_tokens > self.pc_share * (state.pc_tokens + state.pic_tokens)
        return CacheKind.PC if over else CacheKind.PIC


class UnifiedLRU(EvictionPolicy):
    name = "unified-lru"

    def preferred_kind(self, state: CacheState) -> CacheKind:
        if state.oldest_pic is None:
            return CacheKind.PC
        if state.oldest_pc is None:
            return CacheKind.PIC
        return CacheKind.PC if state.oldest_pc < state.oldest_pic else CacheKind.PIC


class FixedPartition(EvictionPolicy):
    name = "fixed-partition"

    def _quota(self, kind: CacheKind, state: CacheState) -> float:
        share = self.pc_share if kind is CacheKind.PC else 1.0 - self.pc_share
        return share * state.capacity_tokens

    def preferred_kind(self, state: CacheState) -> CacheKind:
        def fill(kind: CacheKind) -> float:
            return state.tokens(kind) / max(self._quota(kind, state), 1e-9)
        return CacheKind.PC if fill(CacheKind.PC) >= fill(CacheKind.PIC) else CacheKind.PIC

    def over_quota(self, kind: CacheKind, state: CacheState) -> bool:
        return state.tokens(kind) > self._quota(kind, state)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (SoftShare, UnifiedLRU, FixedPartition)
}


def make_eviction_policy(name: str, pc_share: float = 0.5) -> EvictionPolicy:
    if name not in EVICTION_POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(EVICTION_POLICIES)}")
    return EVICTION_POLICIES[name](pc_share)

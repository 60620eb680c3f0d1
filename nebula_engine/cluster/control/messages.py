"""Typed messages of the control plane: worker events in, prefill plans out.

A worker's cache events are the KV cache's own types (``kvcache.events``, re-exported here with
``CacheKind`` and ``Tier`` as the control plane's vocabulary): the router hands them to the view as the
wire delivered them. The plans are plain frozen dataclasses; the router turns them into wire messages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from nebula_engine.kvcache.events import CacheEvent, CacheKind, EvictEvent, MoveEvent, StoreEvent, Tier

__all__ = ["Action", "CacheEvent", "CacheKind", "DoneEvent", "EvictEvent", "LeadPlan", "MoveEvent", "PrefillPlan",
           "PrefixPlan", "SegmentPlan", "StoreEvent", "Tier", "WorkerEvent"]


@dataclass(frozen=True)
class DoneEvent:
    """Task ``task_id`` finished on ``worker`` (or will never run): its reservation can be freed."""

    worker: int
    seq: int
    task_id: str


WorkerEvent = CacheEvent | DoneEvent


class Action(str, enum.Enum):
    REUSE = "reuse"  # cached (or in-flight) KV on `worker`, moved to the combine home if remote
    COMPUTE = "compute"  # scatter prefill of the segment alone on `worker`
    LOCAL = "local"  # worker-local PIC: the home reuses its own copy if it has one, else computes


@dataclass(frozen=True)
class SegmentPlan:
    index: int  # position of the segment in the request
    key: str  # PIC content id
    num_tokens: int
    worker: int
    action: Action
    task_id: str = ""  # set for COMPUTE: the scatter task whose reservation a DoneEvent frees
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True)
class PrefixPlan:
    """Reuse of the first ``num_segments`` segments through prefix caching, held by ``worker``."""

    worker: int
    num_segments: int
    num_tokens: int


@dataclass(frozen=True)
class LeadPlan:
    """The prompt's lead (its regular tokens between the prefix hit and the first PIC segment) prefilled exactly on
    ``worker``, which holds the same prefix, for the home to read as prefix pages."""

    worker: int
    num_tokens: int
    task_id: str


@dataclass(frozen=True)
class PrefillPlan:
    """Where each piece of one request's prefill happens.

    Invariants: every PIC segment outside the prefix hit appears once in ``segments``; the combine
    prefill of ``combine_tokens`` (prefill-token units) runs on ``combine_home`` after all KV is there;
    afterwards the home holds the request's whole prefix chain ``pc_keys``.
    """

    request_id: str
    combine_home: int
    combine_task_id: str
    combine_tokens: float
    prefix: PrefixPlan | None
    segments: tuple[SegmentPlan, ...]
    pc_keys: tuple[str, ...]
    segment_tokens: tuple[int, ...]  # tokens of every request segment, in order
    estimate: float = 0.0  # planner's completion-time estimate, prefill-token units
    lead: LeadPlan | None = None  # set when another worker prefills the lead; else the home does (in the combine)

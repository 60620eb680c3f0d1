"""The data the engine's two ports (``kv_port.KVPort``, ``request_port.RequestPort``) hand out, and the errors they
raise: plain values, so a caller needs nothing else of the engine to use them.

Pins come back as handles (``SegmentPin``, ``PrefixPin``): the pinned pages stay put until the handle is given
to ``KVPort.unpin_segment`` / ``KVPort.unpin_prefix``; the caller keeps track of which reader holds which handle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from nebula_engine.engine.async_engine import EngineDeadError, EngineError, EngineStats
from nebula_engine.kvcache.events import Tier

__all__ = ["CacheDrain", "EngineDeadError", "EngineError", "EngineStats", "KVGeometry", "PICFormat", "PrefixPin",
           "SegmentPin", "TierLayout"]


@dataclass(frozen=True)
class KVGeometry:
    """How this engine's KV pool is laid out: what a peer's cost model needs."""

    page_size: int  # tokens per page
    num_pages: int
    bytes_per_token: int  # K and V of every attention layer


@dataclass(frozen=True)
class TierLayout:
    """The tiers below this engine's device cache, as it was configured."""

    host_tokens: int  # capacity of the host tier; 0: none
    disk_tokens: int  # capacity of the disk tier; 0: none
    disk_path: Path | None  # the disk tier's directory
    demote_on_evict: bool  # an entry evicted from the device moves down a tier (False: it is dropped)


@dataclass(frozen=True)
class PICFormat:
    """How the PIC segments of requests with one backend are stored, and so which stored entries they can use."""

    model_id: str
    backend_spec: str  # ``PICBackend.spec``: parses back to the backend
    cache_format: str  # backends that store segments alike share it (and their entries)
    keyed_by_prefix: bool  # a segment is prefilled behind the request's prefix, and its key names that prefix


@dataclass(frozen=True)
class SegmentPin:
    """A PIC store entry locked for a remote reader: ``pages`` hold its K/V, ``state`` what it carries beyond
    them (linear-attention state; empty for pure attention models)."""

    pages: tuple[int, ...]
    state: Mapping[str, Any]
    entry: Any = field(repr=False)  # the locked store entry: only the port looks inside


@dataclass(frozen=True)
class PrefixPin:
    """Cached prefix pages locked for a remote reader."""

    pages: tuple[int, ...]
    node: Any = field(repr=False)  # the locked radix node: only the port looks inside


@dataclass(frozen=True)
class CacheDrain:
    """What the cache reported since the last drain; with a snapshot, also every PIC entry it holds now."""

    events: list  # kvcache.events, oldest first
    pic_entries: list[tuple[str, int, Tier]] = field(default_factory=list)  # (key, tokens, tier), device first

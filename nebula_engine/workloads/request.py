"""One request format for every workload: ordered segments with stable content ids.

A segment's ``content_id`` is stable across requests: the same text (or trace id) always gives the
same id, which is what both prefix caching (a chain of ids) and PIC (one id) key on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nebula_engine.pic.segments import SegmentKind


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    content_id: str
    num_tokens: int
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.num_tokens < 0:
            raise ValueError(f"segment {self.content_id!r} has negative length {self.num_tokens}")
        if self.token_ids is not None and len(self.token_ids) != self.num_tokens:
            raise ValueError(f"segment {self.content_id!r}: {len(self.token_ids)} token ids "
                             f"but num_tokens={self.num_tokens}")


@dataclass(frozen=True)
class Request:
    request_id: str
    arrival_time: float  # seconds from the start of the trace
    session_id: str
    segments: tuple[Segment, ...]
    output_tokens: int = 1
    metadata: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

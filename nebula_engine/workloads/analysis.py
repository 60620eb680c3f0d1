"""Theoretical reuse analysis of a request stream: the paper's Table 1 and Table 2 (§3.1).

Requests are processed in list order against an infinite cache that starts empty.

* PC (prefix caching): segment-granular prefix trie over content ids. A request's PC hit is the
  longest run of leading segments whose id chain was seen before as the prefix of an earlier request;
  then its whole chain is inserted.
* PIC (position-independent caching): a token hits if it is a PC hit, or its segment is of kind
  ``pic`` or ``prefix`` and that content id appeared before anywhere (in an earlier request, or
  earlier in the same request). ``regular`` segments are reusable only through PC: that is what the
  kind means. Hence hPIC >= hPC, as the paper requires ("a prefix is a special case of a segment").
* NPHR = hPIC - hPC; PMRR = NPHR / (1 - hPC). All rates are token-weighted over the whole stream
  (sum of hit tokens / sum of input tokens), in percent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nebula_engine.workloads.request import Request, SegmentKind

PERCENTILES = (50, 95, 99)
LOGGED_PROMPT_TOKENS = "logged_prompt_tokens"  # Request.metadata key of a trace-logged input size


@dataclass(frozen=True)
class ReuseStats:
    """Table 1 row; rates in percent of input tokens."""

    num_requests: int
    total_tokens: int
    pc_hit_tokens: int
    pic_hit_tokens: int

    @property
    def pc(self) -> float:
        return _percent(self.pc_hit_tokens, self.total_tokens)

    @property
    def pic(self) -> float:
        return _percent(self.pic_hit_tokens, self.total_tokens)

    @property
    def nphr(self) -> float:
        return self.pic - self.pc

    @property
    def pmrr(self) -> float:
        missed = 100.0 - self.pc
        return 100.0 * self.nphr / missed if missed > 0 else 0.0


@dataclass(frozen=True)
class Distribution:
    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if len(values) == 0:
            return cls(0.0, 0.0, 0.0)
        return cls(*(float(v) for v in np.percentile(np.asarray(values), PERCENTILES)))


@dataclass(frozen=True)
class SegmentStats:
    """Table 2 row: segments per request and segment length (tokens) over every segment occurrence."""

    segments_per_request: Distribution
    segment_length: Distribution


def _percent(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0


class _PrefixTrie:
    """Segment-granular trie: a node is the chain of content ids from the start of a request."""

    def __init__(self):
        self._children: dict[tuple[int, str], int] = {}

    def matched_segments(self, content_ids: Sequence[str]) -> int:
        node = 0
        for depth, content_id in enumerate(content_ids):
            node = self._children.get((node, content_id), -1)
            if node < 0:
                return depth
        return len(content_ids)

    def insert(self, content_ids: Sequence[str]) -> None:
        node = 0
        for content_id in content_ids:
            node = self._children.setdefault((node, content_id), len(self._children) + 1)


def request_hits(requests: Sequence[Request]) -> list[tuple[int, int]]:
    """Per request, in order: (PC hit tokens, PIC hit tokens) against the infinite cache described above."""
    trie = _PrefixTrie()
    seen: set[str] = set()
    hits = []
    for request in requests:
        content_ids = [s.content_id for s in request.segments]
        prefix_len = trie.matched_segments(content_ids)
        pc_hits = pic_hits = 0
        for index, segment in enumerate(request.segments):
            if index < prefix_len:
                pc_hits += segment.num_tokens
                pic_hits += segment.num_tokens
            elif segment.kind is not SegmentKind.REGULAR and segment.content_id in seen:
                pic_hits += segment.num_tokens
            seen.add(segment.content_id)
        trie.insert(content_ids)
        hits.append((pc_hits, pic_hits))
    return hits


def reuse_stats(requests: Sequence[Request]) -> ReuseStats:
    hits = request_hits(requests)
    total = sum(r.num_tokens for r in requests)
    return ReuseStats(len(requests), total, sum(pc for pc, _ in hits), sum(pic for _, pic in hits))


def segment_stats(requests: Sequence[Request]) -> SegmentStats:
    counts = [len(r.segments) for r in requests]
    lengths = [s.num_tokens for r in requests for s in r.segments]
    return SegmentStats(Distribution.of(counts), Distribution.of(lengths))


def logged_size_ratio(requests: Sequence[Request], key: str = LOGGED_PROMPT_TOKENS) -> Distribution | None:
    """Rebuilt input size / logged prompt size, over requests whose metadata logs one (None if none)."""
    ratios = [r.num_tokens / r.metadata[key] for r in requests if r.metadata.get(key)]
    return Distribution.of(ratios) if ratios else None

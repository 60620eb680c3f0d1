"""Where a combine prefill takes each prompt token from: the exact prefix, a cached PIC segment, or fresh compute.

Pure Python (the router estimates combine costs from it too). Positions are absolute prompt positions.

Invariants: ``[0, prefix_len)`` is exact (prefix cache or computed earlier); reused spans lie inside
``[prefix_len, num_tokens - 1)``, are ordered and disjoint; every other position in ``[prefix_len, num_tokens)``
is fresh. The last prompt token is always fresh: its hidden state samples the first output token.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence


@dataclass(frozen=True)
class ReusedSpan:
    start: int  # position of its first reused token
    length: int
    segment_start: int  # position where its PIC segment starts (< start when the prefix covers the segment's head)
    segment_index: int  # which PIC segment of the prompt (index into the caller's list of segments)

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def entry_offset(self) -> int:
        """Index of the first reused token inside the cached segment."""
        return self.start - self.segment_start


@dataclass(frozen=True)
class CombineLayout:
    num_tokens: int
    prefix_len: int
    reused: tuple[ReusedSpan, ...]

    def __post_init__(self) -> None:
        cursor = self.prefix_len
        if not 0 <= self.prefix_len < self.num_tokens:
            raise ValueError(f"prefix of {self.prefix_len} tokens leaves nothing to compute in {self.num_tokens}")
        for span in self.reused:
            if span.start < cursor or span.length <= 0 or span.end > self.num_tokens - 1:
                raise ValueError(f"reused spans must be ordered, disjoint, non-empty and before the last token: "
                                 f"{self.reused} (prefix {self.prefix_len}, {self.num_tokens} tokens)")
            cursor = span.end

    @classmethod
    def plan(cls, num_tokens: int, prefix_len: int, segments: Sequence[tuple[int, int]],
             available: Sequence[bool]) -> CombineLayout:
        """Layout for PIC ``segments`` (start, length) of which ``available[i]`` ones have cached KV.

        The prefix wins where it overlaps a segment (it is exact); the last prompt token is never reused.
        """
        spans = []
        for index, ((start, length), ok) in enumerate(zip(segments, available)):
            first, end = max(start, prefix_len), min(start + length, num_tokens - 1)
            if ok and first < end:
                spans.append(ReusedSpan(first, end - first, start, index))
        return cls(num_tokens, prefix_len, tuple(spans))

    @cached_property
    def reused_positions(self) -> list[int]:
        return [p for span in self.reused for p in range(span.start, span.end)]

    @cached_property
    def reused_position_set(self) -> frozenset[int]:
        return frozenset(self.reused_positions)

    @cached_property
    def fresh_positions(self) -> list[int]:
        return [p for p in range(self.prefix_len, self.num_tokens) if p not in self.reused_position_set]

    def count_reused(self, positions: Sequence[int]) -> int:
        """How many of ``positions`` are reused ones (e.g. the reused tokens a combine recomputed)."""
        return sum(1 for p in positions if p in self.reused_position_set)

    @property
    def num_reused(self) -> int:
        return sum(span.length for span in self.reused)

    @property
    def num_computed(self) -> int:
        """Positions a plain prefill would compute after the prefix."""
        return self.num_tokens - self.prefix_len

    @property
    def question_start(self) -> int:
        """First position after the last reused span: the question / suffix the A³ selection scores from."""
        return self.reused[-1].end if self.reused else self.prefix_len

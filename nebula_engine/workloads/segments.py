"""Building segments: stable content ids, token counts (real or estimated), optional token ids.

Content ids are stable across runs and machines: a text segment's id is the xxh3 hash of its
normalized text, a trace segment's id is the trace's own id prefixed by its field. Identical content
therefore always maps to one id, which is what prefix caching (a chain of ids) and PIC (one id) key on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from nebula_engine.workloads.request import Segment, SegmentKind

Tokenizer = Callable[[str], Sequence[int]]

CHARS_PER_TOKEN = 4
SYNTHETIC_VOCAB = (100, 32_000)  # [low, high): keeps clear of the special-token ids of common vocabularies


def estimate_num_tokens(text: str) -> int:
    """Token count estimate used when no tokenizer is given: ceil(chars / 4)."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def normalize_text(text: str) -> str:
    """Drop trailing spaces and blank lines: agents re-embed the same artifact with those changed
    (ChatDev strips blank lines from code files it pastes into later phase prompts)."""
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())


def text_content_id(text: str) -> str:
    return "text:" + xxhash.xxh3_64_hexdigest(normalize_text(text).encode("utf-8"))


def trace_content_id(field: str, trace_id: int | str) -> str:
    return f"{field}:{trace_id}"


def synthetic_token_ids(content_id: str, num_tokens: int) -> tuple[int, ...]:
    """Deterministic pseudo tokens for a content id: the same id always yields the same tokens."""
    rng = np.random.default_rng(xxhash.xxh64_intdigest(content_id.encode("utf-8")))
    return tuple(rng.integers(*SYNTHETIC_VOCAB, size=num_tokens).tolist())


@dataclass(frozen=True)
class LoadOptions:
    """How a loader builds requests; shared by every workload."""

    limit: int | None = None  # at most this many requests (or trajectories/logs, stated per loader)
    tokenizer: Tokenizer | None = None
    seed: int = 0
    with_token_ids: bool = False

    @property
    def token_source(self) -> str:
        return "tokenizer" if self.tokenizer is not None else f"estimate (chars/{CHARS_PER_TOKEN})"


class SegmentFactory:
    """Makes segments, one shared object per (kind, content), tokenizing each distinct text once."""

    def __init__(self, options: LoadOptions):
        self._tokenizer = options.tokenizer
        self._with_token_ids = options.with_token_ids
        self._cache: dict[tuple[SegmentKind, str], Segment] = {}

    def from_text(self, kind: SegmentKind, text: str) -> Segment:
        content_id = text_content_id(text)
        key = (kind, content_id)
        if key not in self._cache:
            self._cache[key] = self._tokenize(kind, content_id, normalize_text(text))
        return self._cache[key]

    def from_trace(self, kind: SegmentKind, content_id: str, num_tokens: int) -> Segment:
        key = (kind, content_id)
        if key not in self._cache:
            token_ids = synthetic_token_ids(content_id, num_tokens) if self._with_token_ids else None
            self._cache[key] = Segment(kind, content_id, num_tokens, token_ids)
        return self._cache[key]

    def _tokenize(self, kind: SegmentKind, content_id: str, text: str) -> Segment:
        if self._tokenizer is not None:
            token_ids = tuple(self._tokenizer(text))
            return Segment(kind, content_id, len(token_ids), token_ids if self._with_token_ids else None)
        num_tokens = estimate_num_tokens(text)
        token_ids = synthetic_token_ids(content_id, num_tokens) if self._with_token_ids else None
        return Segment(kind, content_id, num_tokens, token_ids)

"""Cache keys of a request: the prefix chain (one key per segment) and its PIC segments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import xxhash

from nebula_engine.pic.segments import SegmentKind


class TraceSegment(Protocol):
    content_id: str
    num_tokens: int
    kind: str


class TraceRequest(Protocol):
    """A workload request as the control plane reads it (``workloads.request.Request`` is one)."""

    request_id: str
    segments: Sequence[TraceSegment]


def token_content_id(token_ids: Sequence[int]) -> str:
    """Content id of a run of regular tokens: a hash of its token ids."""
    return xxhash.xxh3_64_hexdigest(repr(tuple(token_ids)).encode())


def chain_key(parent: str, content_id: str) -> str:
    """Key of a prefix-cache entry: the segment's content chained on everything before it."""
    return xxhash.xxh64_hexdigest(f"{parent}\x1f{content_id}".encode())


@dataclass(frozen=True)
class RequestKeys:
    """``pc_keys[i]`` identifies segments ``0..i`` as a prefix; ``pic_indices`` are PIC segments."""

    request_id: str
    pc_keys: tuple[str, ...]
    content_ids: tuple[str, ...]
    tokens: tuple[int, ...]
    pic_indices: tuple[int, ...]

    @classmethod
    def of(cls, request: TraceRequest) -> "RequestKeys":
        keys, parent = [], ""
        for segment in request.segments:
            parent = chain_key(parent, segment.content_id)
            keys.append(parent)
        return cls(
            request_id=request.request_id,
            pc_keys=tuple(keys),
            content_ids=tuple(s.content_id for s in request.segments),
            tokens=tuple(s.num_tokens for s in request.segments),
            pic_indices=tuple(i for i, s in enumerate(request.segments) if s.kind == SegmentKind.PIC),
        )

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    def prefix_tokens(self, num_segments: int) -> int:
        return sum(self.tokens[:num_segments])


# Regular tokens are keyed in blocks that end at multiples of this many prompt tokens: a cluster's prompts often share
# the start of one regular segment (a system prompt whose end varies), which the engines' page-level prefix caches
# reuse, and a key per whole segment would never match. 256 tokens (16 pages of 16) keeps a prompt's keys and events
# few; what a block boundary hides is under 256 tokens of prefill a hit (~14 ms at the bench model's measured 54 us a
# token, `nebula-engine profile`).
PC_BLOCK_TOKENS = 256


def block_segments(segments: "list[tuple[str, Sequence[int]]]", block_tokens: int = PC_BLOCK_TOKENS
                   ) -> "list[tuple[str, Sequence[int]]]":
    """``segments`` (kind, token ids) in order, each regular one cut where the prompt's offset reaches a multiple
    of ``block_tokens``; PIC segments stay whole. What the router keys a prompt by, and its workers report."""
    blocks, offset = [], 0
    for kind, ids in segments:
        start = 0
        if kind != "pic":
            while (cut := (offset + start) // block_tokens * block_tokens + block_tokens - offset) < len(ids):
                blocks.append((kind, ids[start:cut]))
                start = cut
        blocks.append((kind, ids[start:]))
        offset += len(ids)
    return blocks


def prompt_keys(request_id: str, segments: "list[tuple[str, tuple[int, ...]]]", pic_key) -> RequestKeys:
    """Keys of a real prompt: ``segments`` are (kind, token ids) in order; ``pic_key(ids)`` is the workers'
    PIC store key of a segment (so router records and worker store events name the same entries); a regular
    segment's content id hashes its token ids."""
    content_ids, keys, parent = [], [], ""
    for kind, ids in segments:
        content = pic_key(ids) if kind == "pic" else token_content_id(ids)
        content_ids.append(content)
        parent = chain_key(parent, content)
        keys.append(parent)
    return RequestKeys(request_id=request_id, pc_keys=tuple(keys), content_ids=tuple(content_ids),
                       tokens=tuple(len(ids) for _, ids in segments),
                       pic_indices=tuple(i for i, (kind, _) in enumerate(segments) if kind == "pic"))

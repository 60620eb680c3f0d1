"""Seeded generators for ChatRAG-doc2dial and ChatRAG-QuAC, shaped to the paper's Table 1/2.

Their raw data (nvidia/ChatRAG-Bench) is not available here, so these are SYNTHETIC. A dialogue is
about one document split into chunks; turn t's request is the system prompt (prefix), every chunk of
the document in retrieval order (pic, reshuffled each turn since retrieval ranks by the question),
the earlier questions and answers (pic), and the new question (regular). doc2dial draws documents from
a small shared pool (many dialogues per document: PIC near 100 %); QuAC gives each dialogue its own
document (only the first turn misses). Lengths are log-normal, fitted by hand to the paper's P50/P95/P99.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nebula_engine.workloads.request import Request, Segment, SegmentKind
from nebula_engine.workloads.segments import LoadOptions, SegmentFactory
from nebula_engine.workloads.sessions import SessionCalls, interleave_sessions


@dataclass(frozen=True)
class LogNormal:
    """Log-normal lengths clipped to [low, high]; a ``tail_share`` of draws is ``tail_scale`` times
    longer, since the paper's P99/P95 ratios are heavier than one log-normal gives."""

    median: float
    sigma: float
    low: int
    high: int
    tail_share: float = 0.0
    tail_scale: float = 1.0

    def sample(self, rng: np.random.Generator, size: int | None = None):
        scale = np.where(rng.random(size) < self.tail_share, self.tail_scale, 1.0)
        values = self.median * scale * np.exp(self.sigma * rng.standard_normal(size))
        return np.clip(np.rint(values), self.low, self.high).astype(int)


@dataclass(frozen=True)
class RagDialogueShape:
    name: str
    system_prompt_tokens: int
    shared_documents: int | None  # pool size; None: a fresh document per dialogue
    chunks_per_document: LogNormal
    chunk_tokens: LogNormal
    turns_per_dialogue: tuple[int, int]  # inclusive range, uniform
    question_tokens: LogNormal
    answer_tokens: LogNormal
    default_requests: int


DOC2DIAL = RagDialogueShape(
    name="doc2dial", system_prompt_tokens=770, shared_documents=4,
    chunks_per_document=LogNormal(102, 0.01, 101, 104),
    chunk_tokens=LogNormal(340, 0.38, 40, 1500, tail_share=0.015, tail_scale=3.5),
    turns_per_dialogue=(1, 5), question_tokens=LogNormal(16, 0.4, 4, 64),
    answer_tokens=LogNormal(40, 0.5, 8, 160), default_requests=2000)

QUAC = RagDialogueShape(
    name="quac", system_prompt_tokens=600, shared_documents=None,
    chunks_per_document=LogNormal(24, 0.95, 8, 230),
    chunk_tokens=LogNormal(560, 0.2, 64, 1200, tail_share=0.02, tail_scale=1.7),
    turns_per_dialogue=(4, 12), question_tokens=LogNormal(12, 0.4, 4, 48),
    answer_tokens=LogNormal(20, 0.5, 4, 120), default_requests=2000)


class _DialogueBuilder:
    def __init__(self, shape: RagDialogueShape, options: LoadOptions):
        self.shape = shape
        self.rng = np.random.default_rng(options.seed)
        self.factory = SegmentFactory(options)
        self.system = self._segment(SegmentKind.PREFIX, "system", shape.system_prompt_tokens)
        self.documents: dict[int, list[Segment]] = {}

    def document(self, dialogue: int) -> list[Segment]:
        pool = self.shape.shared_documents
        doc = int(self.rng.integers(pool)) if pool else dialogue
        if doc not in self.documents:
            count = int(self.shape.chunks_per_document.sample(self.rng))
            lengths = self.shape.chunk_tokens.sample(self.rng, count)
            self.documents[doc] = [self._segment(SegmentKind.PIC, f"doc{doc}/chunk{i}", int(n))
                                   for i, n in enumerate(lengths)]
        return self.documents[doc]

    def dialogue(self, index: int) -> SessionCalls:
        chunks = self.document(index)
        first_turns, last_turns = self.shape.turns_per_dialogue
        history: list[Segment] = []
        calls = []
        for turn in range(int(self.rng.integers(first_turns, last_turns + 1))):
            key = f"dialogue{index}/turn{turn}"
            question = self._sampled(SegmentKind.REGULAR, f"{key}/question", self.shape.question_tokens)
            retrieved = [chunks[i] for i in self.rng.permutation(len(chunks))]
            calls.append((self.system, *retrieved, *history, question))
            answer = self._sampled(SegmentKind.PIC, f"{key}/answer", self.shape.answer_tokens)
            # the question comes back in later turns' history as reusable content
            history += [self.factory.from_trace(SegmentKind.PIC, question.content_id, question.num_tokens),
                        answer]
        return SessionCalls(f"{self.shape.name}-{index}", tuple(calls))

    def _sampled(self, kind: SegmentKind, key: str, lengths: LogNormal) -> Segment:
        return self._segment(kind, key, int(lengths.sample(self.rng)))

    def _segment(self, kind: SegmentKind, key: str, num_tokens: int) -> Segment:
        return self.factory.from_trace(kind, f"{self.shape.name}/{key}", num_tokens)


def generate_dialogues(shape: RagDialogueShape, options: LoadOptions) -> list[Request]:
    """``options.limit`` is the number of requests (default ``shape.default_requests``)."""
    target = options.limit if options.limit is not None else shape.default_requests
    builder = _DialogueBuilder(shape, options)
    sessions, total = [], 0
    while total < target:
        sessions.append(builder.dialogue(len(sessions)))
        total += len(sessions[-1].calls)
    return interleave_sessions(sessions, options.seed)[:target]


def generate_doc2dial(_directory: Path | None, options: LoadOptions) -> list[Request]:
    return generate_dialogues(DOC2DIAL, options)


def generate_quac(_directory: Path | None, options: LoadOptions) -> list[Request]:
    return generate_dialogues(QUAC, options)

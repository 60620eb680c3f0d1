"""Replay a workload against an OpenAI-compatible server: Poisson arrivals, streaming completions.

Requests leave in their original order at seeded Poisson arrival times (exponential gaps at rate
``qps``), open loop: a slow server never delays later arrivals. Each request is sent as explicit
segments (``"segments": [{"kind": "regular"|"pic", "token_ids": [...]}]``) so PIC marking survives
without text, plus the same tokens as a flat ``"prompt"`` id list for plain OpenAI servers.

Token ids: a segment's own ids when the workload has them, else synthesized from its content id
(seeded by xxhash, drawn in [100, vocab)), so equal content always gives equal ids. Prompts are
shrunk to ``max_prompt_tokens`` by one scale factor for the whole run (so equal content keeps equal
length and ids), each non-empty segment keeping at least one token; a prompt still too long loses
tokens from its end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import xxhash

from nebula_engine.extras import require_extra
from nebula_engine.workloads.request import Request, Segment, SegmentKind

aiohttp = require_extra("aiohttp", "bench")

logger = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 32_000
LOWEST_TOKEN_ID = 100  # clear of the special-token ids of common vocabularies
WIRE_KIND = {SegmentKind.PREFIX: "regular", SegmentKind.REGULAR: "regular", SegmentKind.PIC: "pic"}


class BenchError(RuntimeError):
    """The replay cannot run at all (server unreachable, nonsensical options)."""


@dataclass(frozen=True)
class ReplayOptions:
    seed: int = 0  # arrival process
    max_tokens: int | None = None  # output tokens of every request; None: the trace's own
    max_prompt_tokens: int | None = None  # shrink prompts to fit a small context; None: as traced
    vocab_size: int | None = None  # None: the server's /v1/models `vocab_size`, else 32000
    model: str | None = None  # None: the first model /v1/models lists
    request_timeout_s: float = 600.0


@dataclass(frozen=True)
class ModelInfo:
    model: str
    vocab_size: int | None
    max_model_len: int | None


@dataclass(frozen=True)
class RequestRecord:
    """One request's outcome; times in seconds from the start of the replay."""

    index: int
    request_id: str
    scheduled_s: float  # Poisson arrival offset
    sent_s: float
    ttft_s: float | None  # None unless a first token arrived
    latency_s: float | None  # end to end; None on failure
    prompt_tokens: int  # as the server's usage says, else as sent
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens; None when not reported
    completion_tokens: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class ReplayResult:
    url: str
    model: str
    qps: float
    seed: int
    vocab_size: int
    prompt_scale: float  # 1.0: prompts as traced
    duration_s: float  # from the start until the last request finished
    records: tuple[RequestRecord, ...]


def poisson_offsets(num_requests: int, qps: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process at rate ``qps``, the first at 0."""
    if not qps > 0 or math.isinf(qps):
        raise BenchError(f"qps must be a positive finite rate, got {qps}")
    gaps = np.random.default_rng(seed).exponential(1.0 / qps, size=num_requests)
    return np.concatenate(([0.0], np.cumsum(gaps[:-1]))).tolist() if num_requests else []


def prompt_scale(requests: list[Request], max_prompt_tokens: int | None) -> float:
    """One factor for the whole run that makes the longest prompt fit ``max_prompt_tokens``."""
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise BenchError(f"max_prompt_tokens must be at least 1, got {max_prompt_tokens}")
    longest = max((r.num_tokens for r in requests), default=0)
    if max_prompt_tokens is None or longest <= max_prompt_tokens:
        return 1.0
    return max_prompt_tokens / longest


class PromptBuilder:
    """Wire segments of requests; each distinct (content, length) is synthesized once."""

    def __init__(self, vocab_size: int, scale: float, max_prompt_tokens: int | None):
        if vocab_size <= LOWEST_TOKEN_ID:
            raise BenchError(f"vocab size must exceed {LOWEST_TOKEN_ID}, got {vocab_size}")
        self.vocab_size, self.scale, self.max_prompt_tokens = vocab_size, scale, max_prompt_tokens
        self._ids: dict[tuple[str, int], list[int]] = {}

    def segments(self, request: Request) -> list[dict]:
        return [{"kind": WIRE_KIND[segment.kind], "token_ids": self._token_ids(segment, length)}
                for segment, length in zip(request.segments, self.lengths(request)) if length]

    def lengths(self, request: Request) -> list[int]:
        """Each segment's length as sent (0: dropped)."""
        lengths, budget = [], self.max_prompt_tokens
        for segment in request.segments:
            length = self._scaled_length(segment.num_tokens)
            if budget is not None:
                length, budget = min(length, budget), budget - min(length, budget)
            lengths.append(length)
        return lengths

    def _scaled_length(self, num_tokens: int) -> int:
        return num_tokens if self.scale == 1.0 or num_tokens == 0 else max(1, int(num_tokens * self.scale))

    def _token_ids(self, segment: Segment, length: int) -> list[int]:
        key = (segment.content_id, length)
        if key not in self._ids:
            if segment.token_ids is not None:
                self._ids[key] = list(segment.token_ids[:length])
            else:
                rng = np.random.default_rng(xxhash.xxh64_intdigest(segment.content_id.encode("utf-8")))
                self._ids[key] = rng.integers(LOWEST_TOKEN_ID, self.vocab_size, size=length).tolist()
        return self._ids[key]


def as_sent(requests: list[Request], max_prompt_tokens: int | None) -> list[Request]:
    """The requests with each segment's length as ``replay`` sends it (token ids dropped): what the server sees,
    for reuse figures of the replayed slice."""
    builder = PromptBuilder(DEFAULT_VOCAB_SIZE, prompt_scale(requests, max_prompt_tokens), max_prompt_tokens)
    return [replace(request, segments=tuple(
        Segment(segment.kind, segment.content_id, length) for segment, length in
        zip(request.segments, builder.lengths(request)) if length)) for request in requests]


async def fetch_model_info(session: aiohttp.ClientSession, url: str) -> ModelInfo:
    try:
        async with session.get(f"{url}/v1/models") as reply:
            reply.raise_for_status()
            entry = (await reply.json())["data"][0]
            return ModelInfo(entry["id"], entry.get("vocab_size"), entry.get("max_model_len"))
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError, ValueError) as error:
        raise BenchError(f"cannot list models at {url}/v1/models: {type(error).__name__}: {error}") from error


async def replay(url: str, requests: list[Request], qps: float, options: ReplayOptions = ReplayOptions(),
                 on_done: Callable[[RequestRecord], None] | None = None) -> ReplayResult:
    """Send ``requests`` in order at Poisson arrival times; one record per request, in order. ``on_done`` is
    called with each record as its request ends (progress reports)."""
    url = url.rstrip("/")
    offsets = poisson_offsets(len(requests), qps, options.seed)
    scale = prompt_scale(requests, options.max_prompt_tokens)
    timeout = aiohttp.ClientTimeout(total=options.request_timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        info = await fetch_model_info(session, url)
        model = options.model or info.model
        vocab_size = options.vocab_size or info.vocab_size or DEFAULT_VOCAB_SIZE
        _warn_if_too_long(requests, scale, options.max_tokens, info)
        builder = PromptBuilder(vocab_size, scale, options.max_prompt_tokens)
        sender = _Sender(session, f"{url}/v1/completions", model, builder, options.max_tokens)
        start = time.perf_counter()
        tasks = []
        for index, (request, offset) in enumerate(zip(requests, offsets)):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(sender.send(index, request, offset, start))
            if on_done is not None:
                task.add_done_callback(lambda done: done.cancelled() or done.exception() or on_done(done.result()))
            tasks.append(task)
        records = tuple(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    return ReplayResult(url, model, qps, options.seed, vocab_size, scale, duration, records)


def _warn_if_too_long(requests: list[Request], scale: float, max_tokens: int | None, info: ModelInfo) -> None:
    longest = max((r.num_tokens * scale + (max_tokens or r.output_tokens) for r in requests), default=0)
    if info.max_model_len is not None and longest > info.max_model_len:
        logger.warning("the longest request (%d tokens with its output) exceeds %s's max_model_len %d: "
                       "expect failures, or pass a max_prompt_tokens", longest, info.model, info.max_model_len)


class _Sender:
    def __init__(self, session: aiohttp.ClientSession, endpoint: str, model: str, builder: PromptBuilder,
                 max_tokens: int | None):
        self.session, self.endpoint, self.model = session, endpoint, model
        self.builder, self.max_tokens = builder, max_tokens

    def body(self, request: Request) -> dict:
        segments = self.builder.segments(request)
        return {
            "model": self.model,
            "prompt": [token for segment in segments for token in segment["token_ids"]],
            "segments": segments,
            "max_tokens": self.max_tokens if self.max_tokens is not None else request.output_tokens,
            "temperature": 0.0,
            "ignore_eos": True,  # fixed output length, so end-to-end latency compares across servers
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def send(self, index: int, request: Request, offset: float, start: float) -> RequestRecord:
        body = self.body(request)
        stream = _StreamState(sent=time.perf_counter())
        try:
            async with self.session.post(self.endpoint, json=body) as reply:
                if reply.status != 200:
                    stream.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                else:
                    await stream.consume(reply.content)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:  # ValueError: bad JSON chunk
            stream.error = f"{type(error).__name__}: {error}"
        return stream.record(index, request.request_id, offset, start, len(body["prompt"]))


@dataclass
class _StreamState:
    sent: float
    first_token: float | None = None
    finished: float | None = None
    usage: dict | None = None
    error: str | None = None

    async def consume(self, content: aiohttp.StreamReader) -> None:
        async for raw in content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[len(b"data:"):].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                self.error = f"stream error: {chunk['error']}"
                return
            if chunk.get("choices") and self.first_token is None:
                self.first_token = time.perf_counter()
            self.usage = chunk.get("usage") or self.usage
        self.finished = time.perf_counter()
        if self.first_token is None:
            self.error = "stream ended before the first token"

    def record(self, index: int, request_id: str, offset: float, start: float, sent_tokens: int) -> RequestRecord:
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        ok = self.error is None
        return RequestRecord(
            index=index, request_id=request_id, scheduled_s=offset, sent_s=self.sent - start,
            ttft_s=self.first_token - self.sent if self.first_token is not None else None,
            latency_s=self.finished - self.sent if ok else None,
            prompt_tokens=usage.get("prompt_tokens", sent_tokens), cached_tokens=details.get("cached_tokens"),
            completion_tokens=usage.get("completion_tokens", 0), error=self.error)

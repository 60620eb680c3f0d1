"""Offline batch prefill: warm the disk tier of the PIC segment store from a JSONL corpus.

Each non-blank line is a JSON object with ``"text"`` (tokenized by ``encode_plain``, exactly as the text between
``<pic>`` tags is at serving time) or ``"token_ids"``, and an optional ``"id"``. Each document is one PIC segment,
keyed by ``KVPort.segment_key`` for the engine's backend. A backend with ``context=prefix`` caches a document
as computed behind the prefix of the requests that will use it, which each line then names with one of
``"system"`` (a chat's system prompt: the template's text up to the user turn's first ``<pic>``),
``"prefix"`` (a completion prompt's text before its first ``<pic>``) or ``"prefix_token_ids"``. A document
already on the disk tier is skipped, so a rerun resumes where a stopped one left off; any other is prefilled by
``KVPort.prefill_missing_segments`` (the scatter prefill a cluster peer runs) and evicted straight down to the disk
tier. The engine is used through its two ports only, as the cluster uses it.

Invariants: the engine has a disk tier and no host tier, so an eviction lands on disk; the device pool holds at
most the document being prefilled; at most ``batch_size`` payloads wait for the disk writer and cache events are
drained per batch, so memory stays bounded whatever the corpus size. A bad line is a counted failure with its
line number, never fatal. Serving finds the entries only with the same model string, dtype, PIC backend cache
format and page size; ``prefill-manifest.json`` beside the index records them (and guards the page size).
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

from nebula_engine.config import EngineConfig
from nebula_engine.engine.async_engine import AsyncLLMEngine
from nebula_engine.engine.kv_port import KVPort
from nebula_engine.engine.port_types import PICFormat
from nebula_engine.engine.request_port import ENGINE_DEFAULT, RequestPort
from nebula_engine.kvcache.events import EvictEvent, Tier

MANIFEST_FILE = "prefill-manifest.json"
UNLIMITED_DISK_TOKENS = 1 << 62
MAX_KEPT_FAILURES = 100  # failures beyond these are counted, not kept
_TAGS = ("<pic>", "</pic>")
PREFIX_FIELDS = ("system", "prefix", "prefix_token_ids")


class DocumentError(ValueError):
    """Why one corpus line cannot be prefilled."""


@dataclass(frozen=True)
class Outcome:
    line: int  # 1-based line number in the corpus file
    doc_id: str | None
    status: str  # "prefilled" | "skipped" (already on disk) | "failed"
    num_tokens: int = 0
    reason: str = ""  # why it failed


@dataclass
class PrefillReport:
    prefilled: int = 0
    skipped: int = 0
    failed: int = 0
    prefilled_tokens: int = 0
    evicted_from_disk: int = 0  # entries the disk tier dropped to stay within its capacity
    failures: list[Outcome] = field(default_factory=list)  # the first MAX_KEPT_FAILURES

    def add(self, outcome: Outcome) -> None:
        if outcome.status == "prefilled":
            self.prefilled += 1
            self.prefilled_tokens += outcome.num_tokens
        elif outcome.status == "skipped":
            self.skipped += 1
        else:
            self.failed += 1
            if len(self.failures) < MAX_KEPT_FAILURES:
                self.failures.append(outcome)


def build_prefill_engine(model: str, disk_cache_path: str | os.PathLike, pic_backend: str = "auto",
                         disk_cache_tokens: int = UNLIMITED_DISK_TOKENS, **options: Any) -> AsyncLLMEngine:
    """An engine whose evictions go straight to the disk tier at ``disk_cache_path``; ``options`` as for ``LLM``."""
    if options.get("host_cache_tokens"):
        raise ValueError("offline prefill writes straight to the disk tier: host_cache_tokens must be 0")
    config = EngineConfig.create(model, pic_backend=pic_backend, disk_cache_path=str(disk_cache_path),
                                 disk_cache_tokens=disk_cache_tokens, host_cache_tokens=0, demote_on_evict=True,
                                 enable_prefix_caching=False, **options)
    return AsyncLLMEngine.from_config(config)


def read_lines(path: str | os.PathLike, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) of each non-blank line, at most ``limit`` of them; streams the file."""
    count = 0
    with open(path, "rb") as corpus:
        for number, raw in enumerate(corpus, start=1):
            if not raw.strip():
                continue
            if limit is not None and count >= limit:
                return
            count += 1
            yield number, raw


class OfflinePrefill:
    """Prefills a corpus through the engine's two ports (``KVPort``, ``RequestPort``), as a cluster peer uses them.

    It owns the engine it is given: ``close`` (or a failed check here) shuts it down. ``run`` is called from
    synchronous code; ``run_async`` from a running event loop."""

    def __init__(self, engine: AsyncLLMEngine, batch_size: int = 16):
        self.kv = KVPort(engine)
        self.requests = RequestPort(engine)
        try:
            self.format = self._check(batch_size)
            self.manifest_path = self.kv.tier_layout.disk_path / MANIFEST_FILE
            self._check_manifest()
        except ValueError:
            self.close()
            raise
        self.batch_size = batch_size

    def _check(self, batch_size: int) -> PICFormat:
        pic_format = self.kv.pic_format(ENGINE_DEFAULT)
        if pic_format is None:
            raise ValueError("offline prefill needs a PIC backend (pic_backend=None turns PIC off)")
        layout = self.kv.tier_layout
        if not layout.disk_tokens:
            raise ValueError("offline prefill needs a disk tier: set disk_cache_tokens and disk_cache_path")
        if layout.host_tokens or not layout.demote_on_evict:
            raise ValueError("offline prefill needs evictions to land on disk: no host tier, demote_on_evict=True")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        return pic_format

    def run(self, path: str | os.PathLike, limit: int | None = None,
            on_outcome: Callable[[Outcome], None] | None = None) -> PrefillReport:
        """Prefill every document of the JSONL corpus at ``path`` not yet on disk; ``on_outcome`` sees each line."""
        return asyncio.run(self.run_async(path, limit, on_outcome))

    async def run_async(self, path: str | os.PathLike, limit: int | None = None,
                        on_outcome: Callable[[Outcome], None] | None = None) -> PrefillReport:
        report = PrefillReport()
        await self.kv.drain_cache_events()  # a restarted disk tier announces what it already holds
        batch: list[str] = []  # keys prefilled since the last flush
        for number, raw in read_lines(path, limit):
            outcome, key = await self.prefill_line(number, raw)
            report.add(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
            if key is not None:
                batch.append(key)
            if len(batch) >= self.batch_size:
                await self._finish_batch(batch, report, str(path))
        await self._finish_batch(batch, report, str(path))
        return report

    async def prefill_line(self, number: int, raw: bytes) -> tuple[Outcome, str | None]:
        """The line's outcome, and its key when it was prefilled now."""
        doc_id = None
        max_model_len = self.requests.max_model_len
        try:
            document = parse_document(raw)
            doc_id = document.get("id")
            token_ids = self.document_token_ids(document)
            context = self.document_context(document)
            if len(context) + len(token_ids) >= max_model_len:
                raise DocumentError(f"a prefix of {len(context)} tokens and {len(token_ids)} document tokens leave "
                                    f"no room under max_model_len {max_model_len}")
        except DocumentError as error:
            return Outcome(number, doc_id, "failed", reason=str(error)), None
        key = self.kv.segment_key(ENGINE_DEFAULT, token_ids, context)
        if await self.kv.segment_tier(key) is Tier.DISK:
            return Outcome(number, doc_id, "skipped", len(token_ids)), None
        [prefilled] = await self.kv.prefill_missing_segments(ENGINE_DEFAULT, [token_ids], context_ids=context)
        if not prefilled:
            page_size = self.kv.page_size
            pages = -(-len(token_ids) // page_size) + -(-len(context) // page_size)
            return Outcome(number, doc_id, "failed", len(token_ids),
                           f"{len(token_ids)} tokens behind a prefix of {len(context)} need {pages} pages; "
                           f"the KV pool has {self.kv.kv_geometry.num_pages}"), None
        await self.kv.evict_unlocked()
        if await self.kv.segment_tier(key) is not Tier.DISK:
            raise RuntimeError(f"segment {key} of line {number} did not reach the disk tier")
        return Outcome(number, doc_id, "prefilled", len(token_ids)), key

    def document_token_ids(self, document: dict[str, Any]) -> list[int]:
        """The segment's ids, as serving tokenizes them; DocumentError if it could not be served."""
        if "text" in document:
            text = document["text"]
            if any(tag in text for tag in _TAGS):
                raise DocumentError("text contains a <pic> or </pic> tag: it could never be served as one segment")
            token_ids = self.requests.tokenizer.encode_plain(text)
        else:
            token_ids = document["token_ids"]
            vocab = self.requests.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise DocumentError(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        if not token_ids:
            raise DocumentError("empty document: it has no tokens")
        if len(token_ids) >= self.requests.max_model_len:
            raise DocumentError(f"too long: {len(token_ids)} tokens, and a request must stay under "
                                f"max_model_len {self.requests.max_model_len}")
        if len(token_ids) > self.kv.tier_layout.disk_tokens:
            raise DocumentError(f"{len(token_ids)} tokens exceed the disk tier's capacity of "
                                f"{self.kv.tier_layout.disk_tokens}")
        return token_ids

    def document_context(self, document: dict[str, Any]) -> tuple[int, ...]:
        """What the document is prefilled behind: the prefix its line names (backend ``context=prefix``), as
        serving tokenizes a request's tokens before its first PIC segment; else the backend's own context."""
        named = [name for name in PREFIX_FIELDS if name in document]
        if not self.format.keyed_by_prefix:
            if named:
                raise DocumentError(f'"{named[0]}" is only for a PIC backend with context=prefix; this engine\'s '
                                    f"is {self.format.backend_spec}")
            return self.kv.segment_context(ENGINE_DEFAULT, (), ())
        if not named:
            raise DocumentError(f"PIC backend {self.format.backend_spec} caches documents behind the requests' "
                                f'prefix: give the line one of {", ".join(PREFIX_FIELDS)}')
        tokenizer = self.requests.tokenizer
        if named[0] == "system":
            segmented = tokenizer.segment_chat([{"role": "system", "content": document["system"]},
                                                {"role": "user", "content": "<pic>document</pic>"}])
        elif named[0] == "prefix":
            segmented = tokenizer.segment_prompt(f"{document['prefix']}<pic>document</pic>")
        else:
            vocab = self.requests.vocab_size
            bad = [t for t in document["prefix_token_ids"] if not 0 <= t < vocab]
            if bad:
                raise DocumentError(f"prefix token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
            return tuple(document["prefix_token_ids"])
        return self.kv.segment_context(ENGINE_DEFAULT, segmented.token_ids, segmented.pic_segments)

    async def _finish_batch(self, batch: list[str], report: PrefillReport, source: str) -> None:
        """Wait for the batch's disk writes, count what the disk dropped, update the manifest."""
        unwritten = await self.kv.flush_tiers(batch)
        if unwritten:
            raise OSError(f"{len(unwritten)} disk tier write(s) failed under {self.kv.tier_layout.disk_path} (see "
                          "the log); what was written is kept: a rerun resumes from there")
        batch.clear()
        drained = await self.kv.drain_cache_events()
        report.evicted_from_disk += sum(isinstance(e, EvictEvent) and e.tier is Tier.DISK for e in drained.events)
        self._write_manifest(report, source)

    def _identity(self) -> dict[str, Any]:
        return {"model_id": self.format.model_id, "pic_backend": self.format.backend_spec,
                "cache_format": self.format.cache_format, "page_size": self.kv.page_size}

    def _check_manifest(self) -> None:
        if not self.manifest_path.exists():
            return
        try:
            page_size = json.loads(self.manifest_path.read_text())["page_size"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{self.manifest_path} is unreadable ({error}); remove it to start over") from None
        if page_size != self.kv.page_size:
            raise ValueError(f"the disk tier at {self.kv.tier_layout.disk_path} holds pages of {page_size} tokens; "
                             f"page size {self.kv.page_size} cannot share it")

    def _write_manifest(self, report: PrefillReport, source: str) -> None:
        counts = {k: v for k, v in asdict(report).items() if k != "failures"}
        manifest = {"version": 1, **self._identity(), "input": source, "last_run": counts}
        tmp = self.manifest_path.with_name(f".{MANIFEST_FILE}.tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, self.manifest_path)

    def close(self) -> None:
        """Finish disk I/O and stop the engine; the disk tier stays valid for the serving engines that will read it."""
        try:
            asyncio.run(self.kv.close_tiers())
        finally:
            self.requests.shutdown()


def parse_document(raw: bytes) -> dict[str, Any]:
    """One corpus line as {"id"?, "text" | "token_ids"}; DocumentError says what is wrong with it."""
    try:
        document = json.loads(raw)
    except UnicodeDecodeError as error:
        raise DocumentError(f"not UTF-8 ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise DocumentError(f"not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(document, dict):
        raise DocumentError(f"a line must be a JSON object, got {type(document).__name__}")
    doc_id = document.get("id")
    if doc_id is not None and (isinstance(doc_id, bool) or not isinstance(doc_id, (str, int))):
        raise DocumentError(f'"id" must be a string or an integer, got {doc_id!r:.40}')
    result = {} if doc_id is None else {"id": str(doc_id)}
    if ("text" in document) == ("token_ids" in document):
        raise DocumentError('a document needs exactly one of "text" or "token_ids"')
    named = [name for name in PREFIX_FIELDS if name in document]
    if len(named) > 1:
        raise DocumentError(f"a document names at most one prefix, got {', '.join(named)}")
    for name in named:
        value = document[name]
        if name == "prefix_token_ids":
            if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
                raise DocumentError('"prefix_token_ids" must be a list of integers')
        elif not isinstance(value, str):
            raise DocumentError(f'"{name}" must be a string, got {type(value).__name__}')
        elif any(tag in value for tag in _TAGS):
            raise DocumentError(f'"{name}" contains a <pic> or </pic> tag: a prefix ends before the first one')
        result[name] = value
    if "text" in document:
        if not isinstance(document["text"], str):
            raise DocumentError(f'"text" must be a string, got {type(document["text"]).__name__}')
        return {**result, "text": document["text"]}
    token_ids = document["token_ids"]
    if not isinstance(token_ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
        raise DocumentError('"token_ids" must be a list of integers')
    return {**result, "token_ids": token_ids}

"""Offline batch prefill: warm the disk tier of the PIC segment store from a JSONL corpus.

Each non-blank line is a JSON object with ``"text"`` (tokenized by ``encode_plain``, exactly as the text between
``<pic>`` tags is at serving time) or ``"token_ids"``, and an optional ``"id"``. Each document is one PIC segment,
keyed by ``PICExecutor.segment_key`` for the engine's backend. A backend with ``context=prefix`` caches a document
as computed behind the prefix of the requests that will use it, which each line then names with one of
``"system"`` (a chat's system prompt: the template's text up to the user turn's first ``<pic>``),
``"prefix"`` (a completion prompt's text before its first ``<pic>``) or ``"prefix_token_ids"``. A document
already on the disk tier is skipped, so a rerun resumes where a stopped one left off; any other is prefilled by
the engine's ``PICExecutor`` (the scatter prefill serving would run) and evicted straight down to the disk tier.

Invariants: the engine has a disk tier and no host tier, so an eviction lands on disk; the device pool holds at
most the document being prefilled; at most ``batch_size`` payloads wait for the disk writer and cache events are
drained per batch, so memory stays bounded whatever the corpus size. A bad line is a counted failure with its
line number, never fatal. Serving finds the entries only with the same model string, dtype, PIC backend cache
format and page size; ``prefill-manifest.json`` beside the index records them (and guards the page size).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

from nebula_engine.config import EngineConfig
from nebula_engine.engine.llm_engine import LLMEngine
from nebula_engine.kvcache.events import CacheKind, EvictEvent, Tier

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
                         disk_cache_tokens: int = UNLIMITED_DISK_TOKENS, **options: Any) -> LLMEngine:
    """An engine whose evictions go straight to the disk tier at ``disk_cache_path``; ``options`` as for ``LLM``."""
    if options.get("host_cache_tokens"):
        raise ValueError("offline prefill writes straight to the disk tier: host_cache_tokens must be 0")
    config = EngineConfig.create(model, pic_backend=pic_backend, disk_cache_path=str(disk_cache_path),
                                 disk_cache_tokens=disk_cache_tokens, host_cache_tokens=0, demote_on_evict=True,
                                 enable_prefix_caching=False, **options)
    return LLMEngine(config)


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
    def __init__(self, engine: LLMEngine, batch_size: int = 16):
        if engine.model_runner.pic_executor is None or engine.pic_backend is None:
            raise ValueError("offline prefill needs a PIC backend (pic_backend=None turns PIC off)")
        tiers = engine.cache_store.tiers
        if tiers is None or tiers.disk is None:
            raise ValueError("offline prefill needs a disk tier: set disk_cache_tokens and disk_cache_path")
        if tiers.host is not None or not tiers.config.demote_on_evict:
            raise ValueError("offline prefill needs evictions to land on disk: no host tier, demote_on_evict=True")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.engine = engine
        self.executor = engine.model_runner.pic_executor
        self.store = engine.cache_store
        self.disk = tiers.disk
        self.backend = engine.pic_backend
        self.batch_size = batch_size
        self.manifest_path = self.disk.root / MANIFEST_FILE
        self._check_manifest()

    def run(self, path: str | os.PathLike, limit: int | None = None,
            on_outcome: Callable[[Outcome], None] | None = None) -> PrefillReport:
        """Prefill every document of the JSONL corpus at ``path`` not yet on disk; ``on_outcome`` sees each line."""
        report = PrefillReport()
        self.store.drain_events()  # a restarted disk tier announces what it already holds
        batch: list[str] = []  # keys prefilled since the last flush
        for number, raw in read_lines(path, limit):
            outcome, key = self.prefill_line(number, raw)
            report.add(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
            if key is not None:
                batch.append(key)
            if len(batch) >= self.batch_size:
                self._finish_batch(batch, report, str(path))
        self._finish_batch(batch, report, str(path))
        return report

    def prefill_line(self, number: int, raw: bytes) -> tuple[Outcome, str | None]:
        """The line's outcome, and its key when it was prefilled now."""
        doc_id = None
        try:
            document = parse_document(raw)
            doc_id = document.get("id")
            token_ids = self.document_token_ids(document)
            context = self.document_context(document)
            if len(context) + len(token_ids) >= self.engine.max_model_len:
                raise DocumentError(f"a prefix of {len(context)} tokens and {len(token_ids)} document tokens leave "
                                    f"no room under max_model_len {self.engine.max_model_len}")
        except DocumentError as error:
            return Outcome(number, doc_id, "failed", reason=str(error)), None
        key = self.executor.segment_key(self.backend, token_ids, context)
        if self.store.tiers.tier_of(CacheKind.PIC, key) is Tier.DISK:
            return Outcome(number, doc_id, "skipped", len(token_ids)), None
        entry = self.executor.prefill_segment(self.backend, key, token_ids, context)
        if entry is None:
            pages = -(-len(token_ids) // self.store.page_size) + -(-len(context) // self.store.page_size)
            return Outcome(number, doc_id, "failed", len(token_ids),
                           f"{len(token_ids)} tokens behind a prefix of {len(context)} need {pages} pages; "
                           f"the KV pool has "
                           f"{self.store.pool.num_pages}"), None
        self.store.pic.unlock(entry)
        self.store.evict_all()
        if self.store.tiers.tier_of(CacheKind.PIC, key) is not Tier.DISK:
            raise RuntimeError(f"segment {key} of line {number} did not reach the disk tier")
        return Outcome(number, doc_id, "prefilled", len(token_ids)), key

    def document_token_ids(self, document: dict[str, Any]) -> list[int]:
        """The segment's ids, as serving tokenizes them; DocumentError if it could not be served."""
        if "text" in document:
            text = document["text"]
            if any(tag in text for tag in _TAGS):
                raise DocumentError("text contains a <pic> or </pic> tag: it could never be served as one segment")
            token_ids = self.engine.tokenizer.encode_plain(text)
        else:
            token_ids = document["token_ids"]
            vocab = self.engine.model_config.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise DocumentError(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        if not token_ids:
            raise DocumentError("empty document: it has no tokens")
        if len(token_ids) >= self.engine.max_model_len:
            raise DocumentError(f"too long: {len(token_ids)} tokens, and a request must stay under "
                                f"max_model_len {self.engine.max_model_len}")
        if len(token_ids) > self.disk.capacity_tokens:
            raise DocumentError(f"{len(token_ids)} tokens exceed the disk tier's capacity of "
                                f"{self.disk.capacity_tokens}")
        return token_ids

    def document_context(self, document: dict[str, Any]) -> tuple[int, ...]:
        """What the document is prefilled behind: the prefix its line names (backend ``context=prefix``), as
        serving tokenizes a request's tokens before its first PIC segment; else the backend's own context."""
        named = [name for name in PREFIX_FIELDS if name in document]
        if self.backend.context != "prefix":
            if named:
                raise DocumentError(f'"{named[0]}" is only for a PIC backend with context=prefix; this engine\'s '
                                    f"is {self.backend.spec}")
            return self.executor.segment_context(self.backend, (), ())
        if not named:
            raise DocumentError(f"PIC backend {self.backend.spec} caches documents behind the requests' prefix: "
                                f'give the line one of {", ".join(PREFIX_FIELDS)}')
        tokenizer = self.engine.tokenizer
        if named[0] == "system":
            segmented = tokenizer.segment_chat([{"role": "system", "content": document["system"]},
                                                {"role": "user", "content": "<pic>document</pic>"}])
        elif named[0] == "prefix":
            segmented = tokenizer.segment_prompt(f"{document['prefix']}<pic>document</pic>")
        else:
            vocab = self.engine.model_config.vocab_size
            bad = [t for t in document["prefix_token_ids"] if not 0 <= t < vocab]
            if bad:
                raise DocumentError(f"prefix token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
            return tuple(document["prefix_token_ids"])
        return self.executor.segment_context(self.backend, segmented.token_ids, segmented.pic_segments)

    def _finish_batch(self, batch: list[str], report: PrefillReport, source: str) -> None:
        """Wait for the batch's disk writes, count what the disk dropped, update the manifest."""
        self.store.flush()
        kind = CacheKind.PIC.value
        unwritten = [key for key in batch if (kind, key) in self.disk and not self.disk.is_written(kind, key)]
        if unwritten:
            raise OSError(f"{len(unwritten)} disk tier write(s) failed under {self.disk.root} (see the log); "
                          "what was written is kept: a rerun resumes from there")
        batch.clear()
        report.evicted_from_disk += sum(isinstance(e, EvictEvent) and e.tier is Tier.DISK
                                        for e in self.store.drain_events())
        self._write_manifest(report, source)

    def _identity(self) -> dict[str, Any]:
        return {"model_id": self.executor.model_id, "pic_backend": self.backend.spec,
                "cache_format": self.backend.cache_format, "page_size": self.store.page_size}

    def _check_manifest(self) -> None:
        if not self.manifest_path.exists():
            return
        try:
            page_size = json.loads(self.manifest_path.read_text())["page_size"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{self.manifest_path} is unreadable ({error}); remove it to start over") from None
        if page_size != self.store.page_size:
            raise ValueError(f"the disk tier at {self.disk.root} holds pages of {page_size} tokens; "
                             f"page size {self.store.page_size} cannot share it")

    def _write_manifest(self, report: PrefillReport, source: str) -> None:
        counts = {k: v for k, v in asdict(report).items() if k != "failures"}
        manifest = {"version": 1, **self._identity(), "input": source, "last_run": counts}
        tmp = self.manifest_path.with_name(f".{MANIFEST_FILE}.tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, self.manifest_path)

    def close(self) -> None:
        """Finish disk I/O; the disk tier stays valid for the serving engines that will read it."""
        self.store.close()


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

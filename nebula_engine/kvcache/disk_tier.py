"""Local-disk tier: one data file per entry plus ``index.json``, surviving process restarts.

Writes and prefetching reads run on one background thread (``put`` / ``prefetch`` return at once;
``flush()`` waits for everything queued), so tier I/O need not hold up a forward pass. The index lists an entry only once its file is completely written, with
its size and SHA-256; a read checks both, and a missing, truncated or corrupt file is reported once
(log + ``num_corrupt``), dropped, and answered as a miss: its bytes are never deserialized.

Files named by the index stay inside the tier's directory: an entry's file must be exactly the name the tier
itself gives it (``{kind}-{key}.kv``, letters, digits, ``_`` and ``-`` only) and must not be a symlink. An index
entry that breaks this (``../x``, an absolute path, a symlink out of the directory) is corrupt: reported once at
load, ignored, and its file is never opened or deleted. Data files are opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from nebula_engine.kvcache.events import CacheKind

logger = logging.getLogger(__name__)

INDEX_FILE = "index.json"
KINDS = frozenset(kind.value for kind in CacheKind)
_KEY = re.compile(r"[A-Za-z0-9_-]+")  # cache keys are hex digests
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True)
class DiskEntry:
    kind: str
    key: str
    num_tokens: int
    file: str
    nbytes: int
    sha256: str
    charge_tokens: int = 0  # capacity it takes (tokens + its state pages' tokens); 0: ``num_tokens``

    @property
    def charge(self) -> int:
        return self.charge_tokens or self.num_tokens


def data_file_name(kind: str, key: str) -> str:
    """The file (kind, key) is stored in; ValueError if kind or key could make it name another path."""
    if kind not in KINDS or not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"disk tier entry ({kind!r}, {key!r:.80}) cannot name a file in the tier's directory")
    return f"{kind}-{key}.kv"


def serialize(payload: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def deserialize(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


class DiskTier:
    def __init__(self, root: str | os.PathLike, capacity_tokens: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_tokens = capacity_tokens
        self.num_corrupt = 0
        self._lock = threading.Lock()  # guards _entries and the index file
        self._entries: OrderedDict[tuple[str, str], DiskEntry] = OrderedDict()  # least recently used first
        self._pending: dict[tuple[str, str], Future] = {}
        self._loads: dict[tuple[str, str], Future] = {}  # prefetches: payload, or None if damaged
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="nebula-disk-tier")
        self._load_index()

    def _load_index(self) -> None:
        path = self.root / INDEX_FILE
        if not path.exists():
            return
        try:
            records = json.loads(path.read_text())["entries"]
            if not isinstance(records, list):
                raise TypeError("'entries' is not a list")
        except (ValueError, KeyError, TypeError) as error:
            self._report(f"index {path} is unreadable ({error}); starting with an empty disk tier")
            return
        rejected = []
        for record in records:
            entry = self._confined_entry(record)
            if entry is None:
                rejected.append(record)
            else:
                self._entries[entry.kind, entry.key] = entry
        if rejected:
            self._report(f"{len(rejected)} entries of {path} are malformed or name a file that is not theirs in "
                         f"this directory (first: {rejected[0]!r:.160}); ignored: those files are neither read nor "
                         "deleted", count=len(rejected))

    def _confined_entry(self, record: Any) -> DiskEntry | None:
        """The index record as an entry, or None unless it is well-formed and its file is its own plain file
        in this directory."""
        try:
            entry = DiskEntry(**record)
            if entry.file != data_file_name(entry.kind, entry.key):
                return None
        except (TypeError, ValueError):
            return None
        counts = (entry.num_tokens, entry.nbytes, entry.charge_tokens)
        if not all(type(n) is int and n >= 0 for n in counts) or not isinstance(entry.sha256, str):
            return None
        path = self.root / entry.file
        return None if path.is_symlink() else entry

    def _report(self, message: str, count: int = 1) -> None:
        self.num_corrupt += count
        logger.warning("disk tier: %s", message)

    @property
    def used_tokens(self) -> int:
        with self._lock:
            return sum(e.charge for e in self._entries.values())

    def entries(self) -> list[DiskEntry]:
        """Held entries, least recently used first (pending writes included)."""
        with self._lock:
            return list(self._entries.values())

    def __contains__(self, ident: tuple[str, str]) -> bool:
        with self._lock:
            return ident in self._entries

    def is_written(self, kind: str, key: str) -> bool:
        """Whether (kind, key) is completely on disk and in the index; False while its write is pending, after
        a failed write, or when it is not held."""
        with self._lock:
            entry = self._entries.get((kind, key))
        return entry is not None and bool(entry.sha256)

    def put(self, kind: str, key: str, num_tokens: int, payload: Any, charge: int | None = None) -> Future:
        """Store ``payload`` under (kind, key) in the background; the entry is held from now on. ``charge``: the
        capacity it takes (default: its tokens)."""
        ident = (kind, key)
        charge_tokens = 0 if charge is None or charge == num_tokens else charge
        entry = DiskEntry(kind, key, num_tokens, data_file_name(kind, key), 0, "", charge_tokens)
        with self._lock:
            self._entries[ident] = entry
            self._entries.move_to_end(ident)
            future = self._executor.submit(self._write, entry, payload)
            self._pending[ident] = future
        return future

    def _write(self, entry: DiskEntry, payload: Any) -> None:
        data = serialize(payload)
        tmp = self.root / f".{entry.file}.tmp"
        _write_no_follow(tmp, data)
        os.replace(tmp, self.root / entry.file)
        digest = hashlib.sha256(data).hexdigest()
        done = DiskEntry(entry.kind, entry.key, entry.num_tokens, entry.file, len(data), digest, entry.charge_tokens)
        with self._lock:
            ident = (entry.kind, entry.key)
            if self._entries.get(ident) is entry:  # not removed while it was being written
                self._entries[ident] = done
            self._pending.pop(ident, None)
            self._write_index()

    def _write_index(self) -> None:
        records = [asdict(e) for e in self._entries.values() if e.sha256]
        tmp = self.root / f".{INDEX_FILE}.tmp"
        _write_no_follow(tmp, json.dumps({"version": 1, "entries": records}).encode())
        os.replace(tmp, self.root / INDEX_FILE)

    def prefetch(self, kind: str, key: str) -> Future | None:
        """Read, verify and deserialize (kind, key) in the background; ``get`` then returns at once.

        None when the entry is not held. The future's result is the payload, or None if damaged.
        """
        ident = (kind, key)
        with self._lock:
            if ident not in self._entries:
                return None
            if ident not in self._loads:
                self._loads[ident] = self._executor.submit(self._load, ident)
            return self._loads[ident]

    def _load(self, ident: tuple[str, str]) -> Any | None:
        with self._lock:
            entry = self._entries.get(ident)
        data = None if entry is None else self._read_verified(entry)
        return None if data is None else deserialize(data)

    def get(self, kind: str, key: str) -> Any | None:
        """The payload, verified against the index; None on a miss or a damaged file (then dropped)."""
        ident = (kind, key)
        with self._lock:
            load = self._loads.pop(ident, None)
        if load is not None:
            payload = load.result()
            if payload is None:
                self.remove(kind, key)
            return payload
        with self._lock:
            future = self._pending.get(ident)
        if future is not None:
            try:
                future.result()
            except OSError as error:
                self._report(f"write of {kind}-{key} failed ({error}); treated as a miss")
                self.remove(kind, key)
                return None
        with self._lock:
            entry = self._entries.get(ident)
        if entry is None:
            return None
        data = self._read_verified(entry)
        if data is None:
            self.remove(kind, key)
            return None
        with self._lock:
            if ident in self._entries:
                self._entries.move_to_end(ident)
        return deserialize(data)

    def _read_verified(self, entry: DiskEntry) -> bytes | None:
        try:
            data = _read_no_follow(self.root / entry.file)
        except OSError as error:
            self._report(f"{entry.file} unreadable ({error}); treated as a miss")
            return None
        if len(data) != entry.nbytes or hashlib.sha256(data).hexdigest() != entry.sha256:
            self._report(f"{entry.file} is truncated or corrupt ({len(data)} of {entry.nbytes} bytes, "
                         "checksum mismatch); treated as a miss")
            return None
        return data

    def remove(self, kind: str, key: str) -> None:
        with self._lock:
            self._loads.pop((kind, key), None)
            entry = self._entries.pop((kind, key), None)
            if entry is None:
                return
            self._executor.submit(self._unlink, entry)

    def _unlink(self, entry: DiskEntry) -> None:
        with self._lock:
            if (entry.kind, entry.key) not in self._entries:
                (self.root / entry.file).unlink(missing_ok=True)
            self._write_index()

    def flush(self) -> None:
        """Wait until every queued write and removal is on disk and in the index."""
        self._executor.submit(lambda: None).result()

    def close(self) -> None:
        self.flush()
        self._executor.shutdown(wait=True)


def _read_no_follow(path: Path) -> bytes:
    with os.fdopen(os.open(path, os.O_RDONLY | _NO_FOLLOW), "rb") as file:
        return file.read()


def _write_no_follow(path: Path, data: bytes) -> None:
    """Write ``path`` itself: a symlink planted there is an error, never a way to write elsewhere."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NO_FOLLOW, 0o644), "wb") as file:
        file.write(data)

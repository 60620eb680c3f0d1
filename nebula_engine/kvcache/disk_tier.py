"""Local-disk tier: one data file per entry plus ``index.json``, surviving process restarts.

Writes and prefetching reads run on one background thread (``put`` / ``prefetch`` return at once;
``flush()`` waits for everything queued), so tier I/O need not hold up a forward pass.

Nothing read back is trusted until it is authenticated. The index lists an entry only once its file is completely
written, with its size and a keyed MAC (``store_key``: HMAC-SHA256 over the entry's kind, key, token counts and
bytes, under the store's key). A read checks both before a byte is deserialized, deserializes with torch's
tensors-only loader, and checks that the result is a payload of the shape this tier writes. Whatever fails (a
missing, truncated, tampered or swapped file, one that does not decode) is reported once (log + ``num_corrupt``),
dropped from the index, and answered as a miss, so the caller recomputes the entry.

Files named by the index stay inside the tier's directory: an entry's file must be exactly the name the tier
itself gives it (``{kind}-{key}.kv``, letters, digits, ``_`` and ``-`` only) and must not be a symlink. An index
entry that breaks this (``../x``, an absolute path, a symlink out of the directory) is corrupt: reported once at
load, ignored, and its file is never opened or deleted. The index and the data files are opened with
``O_NOFOLLOW`` and must be regular files.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import stat
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from nebula_engine.kvcache.events import CacheKind
from nebula_engine.kvcache.store_key import entry_mac, macs_equal, store_key

logger = logging.getLogger(__name__)

INDEX_FILE = "index.json"
INDEX_VERSION = 2  # 1: entries carried a plain SHA-256, which anyone able to write the directory could recompute
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
    mac: str  # store_key.entry_mac of the file's bytes; "" while the write is pending
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
    def __init__(self, root: str | os.PathLike, capacity_tokens: int, key: bytes | None = None):
        """``key``: the secret entries are authenticated with (e.g. ``store_key.derive_key`` of a cluster
        secret, so peers sharing a store agree); None: the store's own key file (``store_key.store_key``)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_tokens = capacity_tokens
        self._key = key if key is not None else store_key(self.root)
        self.num_corrupt = 0
        self._lock = threading.Lock()  # guards _entries and the index file
        self._entries: OrderedDict[tuple[str, str], DiskEntry] = OrderedDict()  # least recently used first
        self._pending: dict[tuple[str, str], Future] = {}
        self._loads: dict[tuple[str, str], Future] = {}  # prefetches: payload, or None if damaged
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="nebula-disk-tier")
        self._load_index()

    def _load_index(self) -> None:
        path = self.root / INDEX_FILE
        try:
            text = _read_no_follow(path)
        except FileNotFoundError:
            return
        except OSError as error:  # a symlink (ELOOP), a directory, a FIFO, no permission
            self._report(f"index {path} cannot be read as a regular file of this directory ({error}); starting "
                         "with an empty disk tier")
            return
        try:
            index = json.loads(text)
            records = index["entries"]
            if not isinstance(records, list):
                raise TypeError("'entries' is not a list")
        except (ValueError, KeyError, TypeError) as error:
            self._report(f"index {path} is unreadable ({error}); starting with an empty disk tier")
            return
        if index.get("version") != INDEX_VERSION:
            self._report(f"index {path} is version {index.get('version')!r}, whose entries carry no MAC; its "
                         f"{len(records)} entries are ignored (recompute them, e.g. with `nebula-engine prefill`)",
                         count=len(records) or 1)
            return
        self._load_records(path, records)

    def _load_records(self, path: Path, records: list) -> None:
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
        if not all(type(n) is int and n >= 0 for n in counts) or not isinstance(entry.mac, str):
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
        return entry is not None and bool(entry.mac)

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
        mac = entry_mac(self._key, entry.kind, entry.key, entry.num_tokens, entry.charge_tokens, data)
        done = DiskEntry(entry.kind, entry.key, entry.num_tokens, entry.file, len(data), mac, entry.charge_tokens)
        with self._lock:
            ident = (entry.kind, entry.key)
            if self._entries.get(ident) is entry:  # not removed while it was being written
                self._entries[ident] = done
            self._pending.pop(ident, None)
            self._write_index()

    def _write_index(self) -> None:
        records = [asdict(e) for e in self._entries.values() if e.mac]
        tmp = self.root / f".{INDEX_FILE}.tmp"
        _write_no_follow(tmp, json.dumps({"version": INDEX_VERSION, "entries": records}).encode())
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
        return None if data is None else self._decoded(entry, data)

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
        payload = self._decoded(entry, data)
        if payload is None:
            self.remove(kind, key)
        return payload

    def _read_verified(self, entry: DiskEntry) -> bytes | None:
        try:
            data = _read_no_follow(self.root / entry.file)
        except OSError as error:
            self._report(f"{entry.file} unreadable ({error}); treated as a miss")
            return None
        expected = entry_mac(self._key, entry.kind, entry.key, entry.num_tokens, entry.charge_tokens, data)
        if len(data) != entry.nbytes or not macs_equal(expected, entry.mac):
            self._report(f"{entry.file} is truncated, corrupt or not written by this store ({len(data)} of "
                         f"{entry.nbytes} bytes, MAC mismatch); dropped, treated as a miss")
            return None
        return data

    def _decoded(self, entry: DiskEntry, data: bytes) -> Any | None:
        """The payload in authenticated ``data``, or None (reported) when it does not decode to one. Only
        reachable with a file this store's key signed, i.e. one written by a version of this code that wrote
        another format, or a bug: still a miss, never an error for the request that needed it."""
        try:
            payload = deserialize(data)
        except Exception as error:  # torch.load raises UnpicklingError, RuntimeError, EOFError, ... by cause
            self._report(f"{entry.file} does not decode ({type(error).__name__}); dropped, treated as a miss")
            return None
        if not _is_payload(payload):
            self._report(f"{entry.file} decodes to {type(payload).__name__}, not a cache payload; dropped, "
                         "treated as a miss")
            return None
        return payload

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


def _is_payload(payload: Any) -> bool:
    """What ``CacheStore`` demotes: a dict whose ``pages`` (and ``state_pages``) are lists of tensors."""
    if not isinstance(payload, dict) or "pages" not in payload:
        return False
    lists = [payload.get(name, []) for name in ("pages", "state_pages")]
    return all(isinstance(tensors, list) and all(isinstance(t, torch.Tensor) for t in tensors) for tensors in lists)


def _read_no_follow(path: Path) -> bytes:
    """The bytes of ``path`` itself: a symlink (ELOOP) or anything but a regular file is an OSError."""
    with os.fdopen(os.open(path, os.O_RDONLY | _NO_FOLLOW | getattr(os, "O_NONBLOCK", 0)), "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        return file.read()


def _write_no_follow(path: Path, data: bytes) -> None:
    """Write ``path`` itself: a symlink planted there is an error, never a way to write elsewhere."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NO_FOLLOW, 0o644), "wb") as file:
        file.write(data)

"""How the peers of one cluster recognise each other: a shared secret, and control frames sealed with it.

- ``cluster_secret`` reads the operator's secret (flag, ``NEBULA_CLUSTER_SECRET``, or a 0600 file); a local
  cluster draws a random one (``new_secret``). Each use gets its own key derived from it (``derive_key``), so
  the Raft password and the control-frame key are never the same bytes.
- ``FrameSealer`` seals every control frame as ``MAGIC | stamp | HMAC-SHA256 tag | body`` and opens incoming
  ones: the tag must verify before the body is decoded; it covers the recipient's name, so a frame sent to one
  peer is rejected by every other. Stamps (ns) grow strictly per sending process, and a receiver accepts from
  each sender only stamps above the last one it accepted, and none from before its own start (minus the
  clock skew it tolerates): a recorded frame cannot be played again.
- ``RateLimitedLog``: rejected frames are logged one line per reason per interval, never a traceback.

Imports nothing from the rest of the package.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import struct
import threading
import time
from pathlib import Path

SECRET_ENV = "NEBULA_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16  # what `openssl rand -hex 8` gives; `new_secret` draws 256 bits
MAGIC = b"NEB1"
_STAMP = struct.Struct(">Q")
TAG_BYTES = hashlib.sha256().digest_size
HEADER_BYTES = len(MAGIC) + _STAMP.size + TAG_BYTES
# Receivers accept a sender's first frame only if it is stamped after their own start minus this. NTP keeps
# hosts of a LAN within milliseconds of each other (RFC 5905); this tolerates unsynchronised clocks up to it.
MAX_CLOCK_SKEW_S = 30.0


class SecretError(ValueError):
    """The cluster secret is missing where one is required, unreadable, or too weak."""


class FrameRejected(Exception):
    """An incoming control frame that is not accepted; ``reason`` groups them for logging."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def new_secret() -> str:
    return secrets.token_hex(32)


def check_secret(secret: str) -> str:
    if len(secret) < MIN_SECRET_CHARS:
        raise SecretError(f"the cluster secret has {len(secret)} characters; it needs at least {MIN_SECRET_CHARS} "
                          "(e.g. `openssl rand -hex 32`)")
    return secret


def read_secret_file(path: str | Path) -> str:
    """The secret in ``path`` (surrounding whitespace dropped); refuses a file others may read."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as error:
        raise SecretError(f"cannot read the cluster secret file {path}: {error.strerror}") from error
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"the cluster secret file {path} is readable by other users "
                          f"(mode {stat.filemode(mode)}): chmod 600 it")
    return check_secret(text)


def cluster_secret(flag: str | None = None, file: str | Path | None = None) -> str | None:
    """The secret from ``--cluster-secret``, else ``--cluster-secret-file``, else ``$NEBULA_CLUSTER_SECRET``."""
    if flag and file:
        raise SecretError("give the cluster secret once: --cluster-secret or --cluster-secret-file, not both")
    if flag:
        return check_secret(flag)
    if file:
        return read_secret_file(file)
    from_env = os.environ.get(SECRET_ENV)
    return check_secret(from_env) if from_env else None


def derive_key(secret: str, purpose: str) -> bytes:
    return hmac.new(secret.encode(), f"nebula-engine/{purpose}".encode(), hashlib.sha256).digest()


class FrameSealer:
    """Seals frames this peer sends and opens frames it receives (see the module doc)."""

    def __init__(self, name: str, secret: str, clock_ns=time.time_ns):
        self.name = name
        self._key = derive_key(secret, "control-frames/v1")
        self._clock_ns = clock_ns
        self._oldest_accepted_ns = clock_ns() - int(MAX_CLOCK_SKEW_S * 1e9)
        self._last_sent_ns = 0
        self._last_accepted_ns: dict[str, int] = {}
        self._lock = threading.Lock()

    def seal(self, recipient: str, body: bytes) -> bytes:
        with self._lock:
            self._last_sent_ns = max(self._clock_ns(), self._last_sent_ns + 1)
            stamp = _STAMP.pack(self._last_sent_ns)
        return MAGIC + stamp + self._tag(recipient, stamp, body) + body

    def open(self, frame: bytes) -> tuple[int, bytes]:
        """(stamp, body) of an authentic frame addressed to this peer; raises ``FrameRejected`` otherwise."""
        if len(frame) < HEADER_BYTES or not frame.startswith(MAGIC):
            raise FrameRejected("unsealed", f"{len(frame)} bytes without a valid header")
        stamp = frame[len(MAGIC):len(MAGIC) + _STAMP.size]
        tag, body = frame[len(MAGIC) + _STAMP.size:HEADER_BYTES], frame[HEADER_BYTES:]
        if not hmac.compare_digest(tag, self._tag(self.name, stamp, body)):
            raise FrameRejected("forged", "its tag does not verify with this cluster's secret")
        return _STAMP.unpack(stamp)[0], body

    def accept(self, sender: str, stamp_ns: int) -> None:
        """Record ``sender``'s stamp; raises ``FrameRejected`` for one not newer than the last accepted."""
        with self._lock:
            floor = self._last_accepted_ns.get(sender, self._oldest_accepted_ns)
            if stamp_ns <= floor:
                raise FrameRejected("replayed", f"stamp of {sender!r} is {(floor - stamp_ns) / 1e9:.3f} s old")
            self._last_accepted_ns[sender] = stamp_ns

    def _tag(self, recipient: str, stamp: bytes, body: bytes) -> bytes:
        mac = hmac.new(self._key, MAGIC + recipient.encode() + b"\0" + stamp, hashlib.sha256)
        mac.update(body)
        return mac.digest()


class RateLimitedLog:
    """At most one warning per ``key`` per ``interval_s``; later ones say how many were suppressed."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, clock=time.monotonic):
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, message: str, *args) -> None:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        suffix = f" ({suppressed} more like it in the last {now - last:.0f} s)" if suppressed else ""
        self.logger.warning(message + suffix, *args)

"""The secret that authenticates a cache store's entries at rest, and the MAC computed with it.

Every entry a store writes outside the process (the disk tier today) carries an HMAC-SHA256 over what it is
(kind, key, token counts, size) and its bytes. A plain checksum only catches accidents: whoever can write the
store's directory could replace an entry's bytes and recompute it, and the engine would serve the forged KV
as if it were the segment's. Without the key no one can produce a MAC the store accepts, and binding the entry's
identity stops an honest file being replayed under another key.

The key is given by the caller (a secret its peers share) or kept in a per-store key file, ``.store-key`` in the
store's directory, created mode 0600 on first use. A key file that is a symlink, not a regular file, not this
user's, or readable by anyone else is refused: its key may be known to someone who could forge entries.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

KEY_FILE = ".store-key"
KEY_BYTES = 32  # RFC 2104 §3: a key shorter than the hash output (SHA-256: 32 bytes) weakens HMAC; longer adds nothing
MAC_DOMAIN = b"nebula-engine kv entry v1"
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


class StoreKeyError(ValueError):
    """The store's key file cannot be trusted or read; the message says how to fix it."""


def store_key(root: str | os.PathLike) -> bytes:
    """The key of the store in ``root``: read from its key file, which is created (0600) when missing."""
    path = Path(root) / KEY_FILE
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    _create_key(path)
    return _read_key(path)


def derive_key(secret: str | bytes, purpose: str = "kv-store") -> bytes:
    """A store key from a secret shared for another use (a cluster secret): never the secret itself."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(raw, f"nebula-engine {purpose}".encode(), hashlib.sha256).digest()


def entry_mac(key: bytes, kind: str, entry_key: str, num_tokens: int, charge_tokens: int, data: bytes) -> str:
    """Hex HMAC-SHA256 of an entry's identity and bytes."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(b"\0".join([MAC_DOMAIN, kind.encode(), entry_key.encode(), str(num_tokens).encode(),
                           str(charge_tokens).encode(), str(len(data)).encode(), b""]))
    mac.update(data)
    return mac.hexdigest()


def macs_equal(expected: str, given: object) -> bool:
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


def _read_key(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | _NO_FOLLOW)
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise StoreKeyError(f"cannot open the cache store key {path} ({error}); it must be this user's regular "
                            "file, not a symlink") from error
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise StoreKeyError(f"the cache store key {path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise StoreKeyError(f"the cache store key {path} belongs to uid {info.st_uid}, not to this user: "
                                "remove it (its entries then count as misses) or run as its owner")
        if info.st_mode & 0o077:
            raise StoreKeyError(f"the cache store key {path} is readable or writable by others (mode "
                                f"{stat.S_IMODE(info.st_mode):o}); anyone who read it can forge cache entries: "
                                "delete it (a new one is made, the old entries count as misses)")
        text = file.read(4 * KEY_BYTES).decode("ascii", errors="replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise StoreKeyError(f"the cache store key {path} does not hold {KEY_BYTES} hex-encoded bytes; delete it")
    return key


def _create_key(path: Path) -> None:
    """Write a fresh key to a private temporary file, then link it into place: a concurrent creator's key wins
    whole or not at all, and no reader ever sees a half-written key."""
    tmp = path.with_name(f"{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(KEY_BYTES) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: theirs is the key
    finally:
        tmp.unlink(missing_ok=True)

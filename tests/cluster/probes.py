"""What an outsider on the network sends a cluster in the security tests: pickles that would leave a marker file
if anything unpickled them, in every framing the peers' listeners might parse, and a view of those listeners."""

from __future__ import annotations

import ipaddress
import os
import pickle
import socket
import struct
import zlib
from pathlib import Path


class _TouchMarker:
    """Unpickling this creates ``path`` (``open(path, "w")``): the proof that a listener ran our code."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def marker_pickle(path: Path) -> bytes:
    return pickle.dumps(_TouchMarker(path))


def pysyncobj_frame(payload: bytes) -> bytes:
    """One pysyncobj TCP frame: native int length, then zlib(pickle) (what an unauthenticated peer unpickles)."""
    data = zlib.compress(payload)
    return struct.pack("i", len(data)) + data


def http_request(payload: bytes, host: str) -> bytes:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    return head + payload


def zmtp_greeting() -> bytes:
    """The 64-byte ZMTP 3.0 greeting (NULL mechanism): enough for a ZMQ socket to read what follows."""
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31


def send_raw(host: str, port: int, data: bytes, timeout: float = 2.0) -> None:
    """Connect, send ``data``, read whatever comes back until the peer closes or ``timeout`` passes."""
    with socket.create_connection((host, port), timeout=timeout) as connection:
        try:
            connection.sendall(data)
            while connection.recv(65536):
                pass
        except OSError:  # reset or timeout: the listener dropped us, which is the point
            pass


def send_to_all(host: str, ports: list[int], datas: list[bytes]) -> None:
    """Every payload to every port, all connections at once (each waits up to 2 s for the listener to hang up)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(port, data) for port in ports for data in datas]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        list(pool.map(lambda job: send_raw(host, *job), jobs))


def payloads(path: Path, host: str) -> list[bytes]:
    raw = marker_pickle(path)
    return [raw, pysyncobj_frame(raw), http_request(raw, host), zmtp_greeting() + raw, b"\0" * 4 + raw]


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on and every UDP socket it has bound, read from
    ``/proc/PID/net`` (the process's own network namespace) and matched to its file descriptors by inode."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if inode in inodes and (state == _TCP_LISTEN or table.startswith("udp")):
                found.append(_address(local))
    return found


_TCP_LISTEN = "0A"


def _address(hex_address: str) -> tuple[str, int]:
    """``/proc/net/tcp``'s "0100007F:1F90" (little-endian words) -> ("127.0.0.1", 8080)."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)), int(port, 16)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

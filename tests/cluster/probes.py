"""What an outsider on the network sends a cluster in the security tests: pickles that would leave a marker file
if anything unpickled them, in every framing the peers' listeners might parse, and a view of those listeners."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import zlib
from pathlib import Path

import psutil


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
    """(address, port) of every TCP socket ``pid`` listens on and every UDP socket it has bound."""
    found = []
    for connection in psutil.Process(pid).net_connections(kind="inet"):
        if connection.type == socket.SOCK_STREAM and connection.status != psutil.CONN_LISTEN:
            continue
        if connection.laddr:
            found.append((connection.laddr.ip, connection.laddr.port))
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

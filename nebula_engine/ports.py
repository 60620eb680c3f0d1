"""Listening addresses checked before a server loads its model: a busy port fails in a second, in one line,
instead of after the load."""

from __future__ import annotations

import errno
import socket


class PortUnavailable(OSError):
    """A server cannot listen on an address; the message names it and the cause."""


def check_listen(host: str, port: int, flag: str = "--port") -> None:
    """Raise :class:`PortUnavailable` unless a listener can bind ``host:port`` now (port 0: any free port, no check).

    Binds with SO_REUSEADDR, as uvicorn and zmq do, so a port left in TIME_WAIT counts as free and one with a
    listener as busy. Another process may still take the port between this check and the server's bind.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise PortUnavailable(f"cannot listen on {host}:{port}: unknown host ({error.strerror})") from error
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise PortUnavailable(f"port {port} on {host} is already in use: stop what listens there or "
                                      f"choose another {flag}") from error
            raise PortUnavailable(f"cannot listen on {host}:{port}: {error.strerror}") from error


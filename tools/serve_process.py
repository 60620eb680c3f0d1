"""``nebula-engine serve`` as a child process for the tools that drive a real server: a free 127.0.0.1 port, start
and wait for ``/health``, stop by its own process group. Standard library only (client subprocesses import it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(serve_args: list[str], port: int, log_path: str | Path, timeout_s: float = 600,
                 cwd: str | Path | None = None) -> subprocess.Popen:
    """``nebula-engine serve --port PORT --log-level warning SERVE_ARGS`` once it answers ``/health``."""
    command = [sys.executable, "-m", "nebula_engine", "serve", "--port", str(port), "--log-level", "warning",
               *serve_args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return process
        except OSError:
            time.sleep(1)  # the model is loading; nothing to wait on but the port
    stop_server(process)
    raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s; see {log_path}")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

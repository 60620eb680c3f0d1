import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # reference_planner, builders

import json  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402

import pytest  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _etcd_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
            return json.load(reply).get("health") == "true"
    except OSError:
        return False


@pytest.fixture
def etcd_endpoint(tmp_path):
    """A throwaway single-node etcd started by hand (no systemd), stopped by its pid; skips without the binary."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd binary not installed (Debian package etcd-server)")
    client_port, peer_port = _free_port(), _free_port()
    client_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    process = subprocess.Popen(
        [binary, "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", client_url,
         "--advertise-client-urls", client_url, "--listen-peer-urls", peer_url,
         "--initial-cluster", f"default={peer_url}", "--initial-advertise-peer-urls", peer_url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _etcd_healthy(client_url):
            if time.monotonic() > deadline or process.poll() is not None:
                raise TimeoutError("etcd did not report healthy within 10 s")
            time.sleep(0.1)
        yield f"127.0.0.1:{client_port}"
    finally:
        process.kill()
        process.wait(timeout=10)

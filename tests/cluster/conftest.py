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
from dataclasses import dataclass  # noqa: E402

from tests.model_cases import checkpoint_factory  # noqa: E402,F401  (fixture of ``engine``)


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


@dataclass(frozen=True)
class EtcdTLS:
    endpoint: str
    ca: str
    cert: str  # a client certificate etcd accepts
    key: str
    password: str  # of etcd user "root"


def _write_certificates(directory: Path) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    paths: dict[str, str] = {}

    def issue(name: str, subject: x509.NameAttribute, issuer_key, issuer_name, *, ca=False, server=False):
        key = ec.generate_private_key(ec.SECP256R1())
        subject_name = x509.Name([subject])
        builder = (x509.CertificateBuilder().subject_name(subject_name).issuer_name(issuer_name or subject_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            # etcd's gateway dials etcd's own gRPC port with the server certificate, so it also needs client use
            usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
            builder = builder.add_extension(x509.ExtendedKeyUsage([*usages, ExtendedKeyUsageOID.CLIENT_AUTH]),
                                            critical=False)
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        certificate = builder.sign(issuer_key or key, hashes.SHA256())
        (directory / f"{name}.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        (directory / f"{name}-key.pem").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        paths[name], paths[f"{name}-key"] = str(directory / f"{name}.pem"), str(directory / f"{name}-key.pem")
        return key, subject_name

    ca_key, ca_name = issue("ca", x509.NameAttribute(NameOID.COMMON_NAME, "nebula test CA"), None, None, ca=True)
    issue("server", x509.NameAttribute(NameOID.COMMON_NAME, "etcd"), ca_key, ca_name, server=True)
    # no common name: etcd 3.4's HTTP gateway refuses client certificates that carry one when auth is on
    issue("client", x509.NameAttribute(NameOID.ORGANIZATION_NAME, "nebula peers"), ca_key, ca_name)
    return paths


@pytest.fixture
def etcd_tls(tmp_path):
    """etcd that only speaks TLS, wants a client certificate from our CA, and has auth on (user root)."""
    binary, control = shutil.which("etcd"), shutil.which("etcdctl")
    if binary is None or control is None:
        pytest.skip("etcd / etcdctl not installed (Debian packages etcd-server, etcd-client)")
    paths = _write_certificates(tmp_path)
    client_port, peer_port = _free_port(), _free_port()
    client_url, peer_url = f"https://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    process = subprocess.Popen(
        [binary, "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", client_url,
         "--advertise-client-urls", client_url, "--listen-peer-urls", peer_url,
         "--initial-cluster", f"default={peer_url}", "--initial-advertise-peer-urls", peer_url,
         "--cert-file", paths["server"], "--key-file", paths["server-key"], "--trusted-ca-file", paths["ca"],
         "--client-cert-auth"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    password = "etcd-test-password"
    ctl = [control, "--endpoints", client_url, "--cacert", paths["ca"], "--cert", paths["client"],
           "--key", paths["client-key"], "--dial-timeout", "2s"]
    try:
        deadline = time.monotonic() + 15
        while subprocess.run([*ctl, "endpoint", "health"], capture_output=True,
                             env={"ETCDCTL_API": "3"}).returncode != 0:
            if time.monotonic() > deadline or process.poll() is not None:
                raise TimeoutError("etcd with TLS did not report healthy within 15 s")
            time.sleep(0.2)
        for command in (["user", "add", f"root:{password}"], ["auth", "enable"]):
            subprocess.run([*ctl, *command], check=True, capture_output=True, env={"ETCDCTL_API": "3"})
        yield EtcdTLS(f"127.0.0.1:{client_port}", paths["ca"], paths["client"], paths["client-key"], password)
    finally:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def engine(checkpoint_factory):
    """A running async engine on a tiny Qwen3 (4-token pages), for tests that play the other peers in-process."""
    from nebula_engine.config import EngineConfig
    from nebula_engine.engine.async_engine import AsyncLLMEngine
    from tests.model_cases import CASES_BY_NAME

    model = checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"])
    running = AsyncLLMEngine.from_config(EngineConfig.create(str(model), page_size=4, num_pages=256))
    yield running
    running.shutdown()

"""A port a server cannot listen on fails in one line naming it, before the model (or a cluster) starts."""

import socket

import pytest
from click.testing import CliRunner

from nebula_engine.cluster.runtime.spec import ClusterSpec, PeerSpec
from nebula_engine.ports import PortUnavailable, check_listen
from nebula_engine.cli.serve import serve


@pytest.fixture
def busy_port():
    """A port with a listener on 127.0.0.1 for the test's duration."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_free_port_and_port_zero_pass():
    check_listen("127.0.0.1", free_port())
    check_listen("127.0.0.1", 0)


def test_a_busy_port_is_named_with_the_flag_that_moves_it(busy_port):
    with pytest.raises(PortUnavailable, match=rf"^port {busy_port} on 127.0.0.1 is already in use: stop what "
                                              r"listens there or choose another --http-port$"):
        check_listen("127.0.0.1", busy_port, "--http-port")


def test_an_address_this_machine_does_not_have_is_named():
    with pytest.raises(PortUnavailable, match=r"^cannot listen on 192.0.2.1:8000: "):  # TEST-NET-1, never local
        check_listen("192.0.2.1", 8000)
    with pytest.raises(PortUnavailable, match=r"^cannot listen on no-such-host.invalid:8000: unknown host"):
        check_listen("no-such-host.invalid", 8000)


def test_serve_refuses_a_busy_port_before_loading_the_model(busy_port):
    # the model path does not exist: had serve looked at it first, the error would name it instead
    result = CliRunner().invoke(serve, ["--model", "/nonexistent", "--port", str(busy_port)])
    assert result.exit_code == 1
    assert result.output.strip() == (f"Error: port {busy_port} on 127.0.0.1 is already in use: stop what listens "
                                     "there or choose another --port")


def listener_after_a_free_port() -> tuple[socket.socket, int]:
    """A listening socket on port P+1 where P is free now."""
    for _ in range(50):
        port = free_port()
        listener = socket.socket()
        try:
            listener.bind(("127.0.0.1", port + 1))
        except OSError:
            listener.close()
            continue
        listener.listen()
        return listener, port
    raise RuntimeError("no free port followed by a bindable one")


def test_a_local_cluster_refuses_a_busy_port_before_starting_peers():
    listener, port = listener_after_a_free_port()
    with listener:  # peers listen on --port, --port+1: the second one is busy
        result = CliRunner().invoke(serve, ["--model", "smollm2", "--prefill-workers", "1", "--decode-workers", "1",
                                            "--port", str(port)])
    assert result.exit_code == 1, result.output
    assert f"port {port + 1} on 127.0.0.1 is already in use" in result.output and "--port+1" in result.output


def test_a_cluster_peer_refuses_its_busy_control_port_before_loading(tmp_path, busy_port):
    peer = PeerSpec("prefill-0", "prefill", "127.0.0.1", ctrl_port=busy_port, raft_port=free_port(),
                    http_port=free_port(), worker_index=0)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(ClusterSpec((peer,)).to_json())
    result = CliRunner().invoke(serve, ["--model", "/nonexistent", "--cluster", str(spec_file), "--name", "prefill-0"])
    assert result.exit_code == 1, result.output
    assert f"port {busy_port} on 127.0.0.1 is already in use" in result.output
    assert f"prefill-0's ctrl_port in {spec_file}" in result.output

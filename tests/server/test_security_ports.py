"""``--port-range``: every port a local cluster opens (HTTP, control, Raft, NIXL's UCX listeners) lies in it, and a
range too small, a backwards one or a --port outside it is a clear error before anything starts."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from nebula_engine.cluster.runtime.launcher import (UCX_PORT_RANGE_ENV, LocalCluster, PortRange, free_ports,
                                                    local_spec, with_new_ports)
from nebula_engine.cli.serve import serve


def a_free_range(width: int) -> PortRange:
    """A window of ``width`` ports above a port the kernel just found free (most of it is free too)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
    low = min(base, 65535 - width)
    return PortRange(low, low + width - 1)


def listened_ports(spec) -> list[int]:
    return [port for peer in spec.peers for _, port, _ in spec.listen_addresses(peer.name)]


def test_every_port_of_a_local_cluster_is_drawn_from_the_range():
    port_range = a_free_range(64)
    spec = local_spec(2, 1, port_range=port_range)
    ports = listened_ports(spec)
    assert len(ports) == 9 and len(set(ports)) == 9 and all(p in port_range for p in ports)
    redrawn = with_new_ports(spec, keep_http=False, port_range=port_range)
    assert all(p in port_range for p in listened_ports(redrawn))


def test_nixl_listeners_are_confined_to_the_range_through_ucx():
    port_range = a_free_range(64)
    cluster = LocalCluster("/nonexistent", local_spec(1, 0, port_range=port_range), port_range=port_range)
    try:
        assert cluster._peer_env()[UCX_PORT_RANGE_ENV] == str(port_range)
    finally:
        cluster.stop()


def test_a_range_without_enough_free_ports_is_an_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match="has 0 free ports.*needs 1"):
            free_ports(1, port_range=PortRange(port, port))


def test_given_http_ports_must_lie_in_the_range():
    with pytest.raises(ValueError, match="not all in --port-range"):
        local_spec(2, 0, port=30000, port_range=PortRange(30001, 30100))


@pytest.mark.parametrize("text", ["20000", "a-b", "200-100", "0-10", "1-70000"])
def test_a_malformed_range_is_refused(text):
    with pytest.raises(ValueError):
        PortRange.parse(text)


def test_the_cli_checks_the_range_before_loading_a_model():
    result = CliRunner().invoke(serve, ["--model", "/nonexistent", "--prefill-workers", "1", "--port-range", "9-3"])
    assert result.exit_code == 2 and "LOW <= HIGH" in result.output
    result = CliRunner().invoke(serve, ["--model", "/nonexistent", "--port-range", "20000-20100"])
    assert result.exit_code == 2 and "for a local cluster" in result.output

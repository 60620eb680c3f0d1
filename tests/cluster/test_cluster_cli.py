"""``nebula-engine serve`` in cluster mode refuses insecure or inconsistent settings before starting anything."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from nebula_engine.cluster.runtime.spec import ClusterSpec, PeerSettings, PeerSpec, check_secured
from nebula_engine.cli.serve import serve


def spec_file(tmp_path, host: str):
    peers = (PeerSpec("prefill-0", "prefill", host, 7001, 7002, 8000, 0),
             PeerSpec("decode-0", "decode", host.replace(".10", ".11"), 7001, 7002, 8000, -1))
    path = tmp_path / "cluster.json"
    path.write_text(ClusterSpec(peers).to_json())
    return path


def run(*args, env=None):
    return CliRunner().invoke(serve, ["--model", "/nonexistent/model", *args],
                              env={"NEBULA_CLUSTER_SECRET": None, **(env or {})})


def test_a_cluster_spanning_machines_needs_a_secret(tmp_path):
    result = run("--cluster", str(spec_file(tmp_path, "10.213.0.10")), "--name", "prefill-0")
    assert result.exit_code == 2 and "--cluster-secret" in result.output and "spans machines" in result.output


@pytest.mark.parametrize("args, env, message", [
    (["--cluster-secret", "short"], None, "at least 16"),
    ([], {"NEBULA_CLUSTER_SECRET": "short"}, "at least 16"),
    (["--peer-timeout", "5", "--failover-timeout", "4"], None, "must exceed --peer-timeout"),
    (["--etcd-user", "root"], {"NEBULA_ETCD_PASSWORD": "pw", "NEBULA_CLUSTER_SECRET": "s" * 16}, None),
])
def test_bad_cluster_settings_are_usage_errors(tmp_path, args, env, message):
    result = run("--cluster", str(spec_file(tmp_path, "10.213.0.10")), "--name", "nobody", *args, env=env)
    assert result.exit_code == 2
    assert (message or "no peer named 'nobody'") in result.output, result.output


def test_a_secret_file_readable_by_others_is_refused(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o644)
    result = run("--prefill-workers", "1", "--cluster-secret-file", str(secret))
    assert result.exit_code == 2 and "chmod 600" in result.output


def test_a_loopback_cluster_without_a_secret_only_warns(caplog):
    peers = (PeerSpec("prefill-0", "prefill", "127.0.0.1", 7001, 7002, 8000, 0),)
    check_secured(ClusterSpec(peers), PeerSettings())
    assert "no cluster secret" in caplog.text
    assert "hunter2" not in repr(PeerSettings(cluster_secret="hunter2" * 3, api_key="hunter2"))


def test_the_spec_json_round_trips_with_and_without_an_http_host():
    peer = PeerSpec("p", "prefill", "127.0.0.1", 1, 2, 3, 0, http_host="0.0.0.0")
    spec = ClusterSpec((peer,))
    assert ClusterSpec.from_json(spec.to_json()) == spec
    data = json.loads(spec.to_json())
    del data["peers"][0]["http_host"]  # a spec written before the field existed
    assert ClusterSpec.from_json(json.dumps(data)).peers[0].url == "http://127.0.0.1:3"
    assert peer.url == "http://0.0.0.0:3" and not spec.spans_machines


@pytest.mark.parametrize("field", ["remote_read_latency_s", "scatter_dispatch_s"])
def test_the_spec_carries_the_planners_fixed_costs(field):
    peer = PeerSpec("p", "prefill", "127.0.0.1", 1, 2, 3, 0)
    spec = ClusterSpec((peer,), **{field: 0.25})
    assert getattr(ClusterSpec.from_json(spec.to_json()), field) == 0.25
    data = json.loads(spec.to_json())
    del data[field]  # a spec written before the field existed: the measured default
    assert getattr(ClusterSpec.from_json(json.dumps(data)), field) == getattr(ClusterSpec, field)
    with pytest.raises(ValueError, match=field):
        ClusterSpec((peer,), **{field: -1.0})


@pytest.mark.parametrize("field,default", [("shared_cores", True), ("observe_transfer_costs", False)])
def test_the_spec_carries_its_planner_switches(field, default):
    peer = PeerSpec("p", "prefill", "127.0.0.1", 1, 2, 3, 0)
    spec = ClusterSpec((peer,), **{field: not default})
    assert getattr(ClusterSpec.from_json(spec.to_json()), field) is (not default)
    data = json.loads(spec.to_json())
    del data[field]  # a spec written before the field existed
    assert getattr(ClusterSpec.from_json(json.dumps(data)), field) is default
    assert getattr(ClusterSpec((peer,)), field) is default

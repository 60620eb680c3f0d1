"""One engine peer process of a cluster: engine + data plane + (when elected) router + HTTP front end.

Everything but the engine loop and NIXL reads runs on one asyncio loop: the ZMQ inbox, the router (only
active on the leader), the worker's command handlers, the front end and the uvicorn server. A peer only learns
who leads from its election, and forgets the leader while it has no quorum or hears nothing from it; the router
state it builds when it starts leading comes from worker snapshots. Every peer heartbeats every other one.

Run as ``python -m nebula_engine.cluster.runtime.peer --spec cluster.json --name NAME --engine-options JSON``
(``nebula-engine serve`` does this for each peer of a local cluster). Secrets come from the environment
(``NEBULA_CLUSTER_SECRET``, ``NEBULA_API_KEY``, ``NEBULA_ETCD_PASSWORD``) or a 0600 file, never from the command
line, where ``ps`` would show them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
from dataclasses import replace
from pathlib import Path

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.auth import SecretError, cluster_secret, derive_key
from nebula_engine.cluster.control.config import ClusterConfig, ClusterProfile, TransferLink
from nebula_engine.cluster.runtime.election import ETCD_PASSWORD_ENV, EtcdAccess, EtcdElection, LeaderElection, RaftElection
from nebula_engine.cluster.runtime.frontend import ClusterFrontend
from nebula_engine.cluster.runtime.liveness import HEARTBEAT_S, Liveness
from nebula_engine.cluster.runtime.router import RouterService
from nebula_engine.cluster.runtime.spec import API_KEY_ENV, ClusterSpec, PeerSettings, check_secured
from nebula_engine.cluster.runtime.transfer import KVTransferAgent, TransferError, confine_ucx_to
from nebula_engine.cluster.runtime.transport import Messenger
from nebula_engine.cluster.runtime.worker import WorkerService

logger = logging.getLogger(__name__)

TICK_S = 0.1


class Peer:
    def __init__(self, spec: ClusterSpec, name: str, engine_options: dict, model: str, served_model_name: str,
                 settings: PeerSettings = PeerSettings()):
        check_secured(spec, settings)
        self.spec = spec
        self.settings = settings
        self.me = spec.peer(name)
        self.name = name
        self.engine_options = dict(engine_options)
        self.model = model
        self.served_model_name = served_model_name
        self.leader_name: str | None = None
        self._stopping = asyncio.Event()
        self._hello_sent: set[str] = set()

    # ---- startup ----
    def _build(self) -> None:
        from nebula_engine.config import EngineConfig
        from nebula_engine.engine.async_engine import AsyncLLMEngine
        from nebula_engine.pic.backends.base import has_linear_attention

        options = {**self.engine_options, "worker_id": max(self.me.worker_index, 0)}
        self.engine = AsyncLLMEngine.from_config(EngineConfig.create(self.model, **options))
        storage = self.engine.engine.model_runner.kv_storage
        confine_ucx_to(self.me.host)
        self.agent = KVTransferAgent.for_storage(self.name, storage)
        self.messenger = Messenger(self.name, f"tcp://{self.me.host}:{self.me.ctrl_port}",
                                   {p.name: p.ctrl_address for p in self.spec.peers if p.name != self.name},
                                   self.settings.cluster_secret)
        settings, peer_names = self.settings, [p.name for p in self.spec.peers]
        self.liveness = Liveness(self.name, peer_names, settings.peer_timeout_s)
        self.worker = WorkerService(self.name, self.me.role, self.me.worker_index, self.engine, self.agent,
                                    self.send, lambda: self.leader_name, self._pic_key, self.liveness)
        self.worker.local_router = self.dispatch
        model = self.engine.engine.model_runner.model
        self.router = RouterService(self.name, [p.name for p in self.spec.prefill_peers],
                                    [p.name for p in self.spec.decode_peers], self._cluster_config(), self.spec.policy,
                                    self.send, self._pic_key, decode_here=has_linear_attention(model),
                                    dead_after_s=settings.peer_timeout_s)
        self.election = self._election()
        self.frontend = ClusterFrontend(self.name, self.engine, self.messenger.send, lambda: self.leader_name,
                                        lambda: self.election.has_quorum, self.dispatch,
                                        [p.name for p in self.spec.prefill_peers], self.liveness,
                                        settings.failover_timeout_s, max_losses=len(peer_names))

    def _cluster_config(self) -> ClusterConfig:
        """The planner's cost model for this machine: the engine's real KV size, loopback NIXL bandwidth."""
        engine = self.engine.engine
        storage = engine.model_runner.kv_storage
        bytes_per_token = sum(t[0].numel() * t.element_size() for tensors in storage.layer_caches for t in tensors
                              ) // storage.page_size
        base = ClusterProfile.load()
        # loopback NIXL moves ~1 GB/s; a read's fixed cost (pin and insert between engine steps) is the spec's
        # remote_read_latency_s, paid once per source (TransferCosts.latency)
        loopback = TransferLink(bandwidth_bytes_per_s=1.0e9, latency_s=self.spec.remote_read_latency_s)
        profile = replace(base, name="local-cpu", kv_bytes_per_token=max(1, bytes_per_token), intra_node=loopback,
                          inter_node=loopback, gpus_per_node=len(self.spec.peers),
                          cache_capacity_tokens=storage.num_pages * storage.page_size,
                          prefill=replace(base.prefill, per_token_s=self._measure_prefill_per_token(), fixed_s=0.01))
        return ClusterConfig(num_prefill_workers=len(self.spec.prefill_peers), profile=profile)

    def _measure_prefill_per_token(self, tokens: int = 256) -> float:
        """Seconds per prefilled token of this model here (best of 3 forwards): the planner's cost unit."""
        import time

        import torch

        from nebula_engine.kernels.attention import AttentionContext

        model = self.engine.engine.model_runner.model
        device = next(model.parameters()).device
        ids = torch.randint(100, 1000, (tokens,), device=device)
        best = float("inf")
        with torch.inference_mode():
            for _ in range(3):
                start = time.perf_counter()
                model.forward(ids, torch.arange(tokens, device=device), AttentionContext.dense([tokens]))
                best = min(best, time.perf_counter() - start)
        return best / tokens

    def _pic_key(self, spec: str | None, ids: list[int]) -> str:
        return self.engine.engine.segment_key(spec, ids)

    def _election(self) -> LeaderElection:
        if self.spec.etcd:
            host, _, port = self.spec.etcd.rpartition(":")
            return EtcdElection(self.name, host, int(port), access=self.settings.etcd_access)
        peers = {p.name: f"{p.host}:{p.raft_port}" for p in self.spec.peers}
        secret = self.settings.cluster_secret
        password = derive_key(secret, "raft/v1").hex() if secret else None
        return RaftElection(self.name, peers[self.name], peers, password)

    # ---- messaging ----
    def send(self, peer: str, message: wire.Msg) -> None:
        if peer == self.name:
            self.dispatch(message)
        else:
            self.messenger.send(peer, message)

    def dispatch(self, msg: wire.Msg) -> None:
        """Route one message to the component that handles it (on the event loop)."""
        if msg.sender != self.name:
            self.liveness.heard(msg.sender)
            if self.router.active:
                self.router.seen(msg.sender)
        spawn = asyncio.get_running_loop().create_task
        match msg:
            case wire.Hello():
                self._on_hello(msg)
            case wire.Heartbeat():
                pass
            case wire.Submit():
                self.router.on_submit(msg)
            case wire.NotLeader():
                self.frontend.on_not_leader(msg)
            case wire.Scatter():
                spawn(self.worker.on_scatter(msg))
            case wire.Combine():
                spawn(self.worker.on_combine(msg))
            case wire.SnapshotRequest():
                spawn(self.worker.pump_events(snapshot=True))
            case wire.PCShare():
                spawn(self.engine.call(lambda e: e.cache_store and e.cache_store.set_pc_share(msg.pc_share)))
            case wire.CacheEventMsg():
                self.router.on_cache_events(msg)
            case wire.TaskDone():
                self.router.on_task_done(msg)
            case wire.PinSegment():
                spawn(self.worker.on_pin(msg))
            case wire.PinReply():
                self.worker.on_pin_reply(msg)
            case wire.Unpin():
                spawn(self.worker.on_unpin(msg))
            case wire.PinPrefix():
                spawn(self.worker.on_pin_prefix(msg))
            case wire.UnpinPrefix():
                spawn(self.worker.on_unpin_prefix(msg))
            case wire.Handoff():
                spawn(self.worker.on_handoff(msg))
            case wire.HandoffDone():
                self.worker.on_handoff_done(msg)
            case wire.Output() | wire.Failed():
                self.frontend.on_output(msg)
            case wire.Abort():
                self.worker.on_abort(msg)

    def _hello(self, reply: bool) -> wire.Hello:
        return wire.Hello(sender=self.name, role=self.me.role, worker_index=self.me.worker_index,
                          nixl_metadata=self.agent.metadata(), reply=reply)

    def _on_hello(self, msg: wire.Hello) -> None:
        try:
            self.agent.add_peer(msg.sender, msg.nixl_metadata)  # a restarted peer replaces its old entry
        except (ValueError, TransferError) as error:
            logger.error("%s: cannot read KV from %s: %s", self.name, msg.sender, error)
        if not msg.reply:
            self.messenger.send(msg.sender, self._hello(reply=True))

    def _refresh_leader(self) -> None:
        """The election's leader, unless it has been silent for the peer timeout (cut off from this peer)."""
        leader = self.election.leader
        if leader is not None and not self.liveness.alive(leader):
            leader = None
        if leader != self.leader_name:
            self._on_leader_change(leader)

    def _on_leader_change(self, leader: str | None) -> None:
        if leader == self.leader_name:
            return
        logger.info("%s: leader is now %s", self.name, leader)
        previous, self.leader_name = self.leader_name, leader
        if leader == self.name and not self.router.active:
            self.router.activate()
        elif leader != self.name and self.router.active:
            self.router.deactivate()
        self.frontend.on_leader_change(leader, previous)

    # ---- run ----
    async def run(self) -> None:
        import uvicorn

        from nebula_engine.server.api import build_app

        self._build()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stopping.set)
        for peer in self.spec.peers:
            if peer.name != self.name:
                self.messenger.send(peer.name, self._hello(reply=False))
        self.election.on_change = lambda leader: loop.call_soon_threadsafe(self._refresh_leader)
        self.election.start()
        app = build_app(self.frontend, self.served_model_name, api_key=self.settings.api_key,
                        max_request_bytes=self.settings.max_request_bytes)
        self._register_metrics(app)

        @app.get("/cluster")
        async def cluster_state() -> dict:
            """This peer's view of the cluster (for operators and tests)."""
            engine = self.engine.stats()
            return {"name": self.name, "role": self.me.role, "leader": self.leader_name,
                    "quorum": self.election.has_quorum, "dropped_frames": self.messenger.num_dropped,
                    "engine": {"running": engine.num_running, "waiting": engine.num_waiting},
                    "router": {"active": self.router.active, "in_flight": len(self.router.in_flight),
                               "planned": self.router.num_planned, "lost": self.router.num_lost,
                               "dead": sorted(self.router.dead)},
                    "transfer_bytes": self.worker.transfer_bytes, "transfer_failures": self.worker.transfer_failures,
                    "resubmitted": self.frontend.num_resubmitted, "nixl_peers": sorted(self.agent.peers),
                    "pic": vars(self.engine.engine.model_runner.pic_executor.stats)
                    if self.engine.engine.model_runner.pic_executor else {}}
        server = uvicorn.Server(uvicorn.Config(app, host=self.me.api_host, port=self.me.http_port,
                                               log_level="warning", lifespan="off"))
        server.install_signal_handlers = lambda: None
        tasks = [loop.create_task(coro) for coro in (server.serve(), self._inbox(), self._ticks())]
        try:
            await self._stopping.wait()
        finally:
            server.should_exit = True
            for task in tasks[1:]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.election.stop()
            self.engine.shutdown()
            self.agent.close()
            self.messenger.close()

    async def _inbox(self) -> None:
        while True:
            message = await self.messenger.recv()
            try:
                self.dispatch(message)
            except Exception:
                logger.exception("handling %s from %s failed", type(message).__name__, message.sender)

    async def _ticks(self) -> None:
        """Heartbeats to every peer, the leader and the front end's requests checked, cache events to the router,
        and (on the leader) liveness checks."""
        beat = 0
        while True:
            await asyncio.sleep(TICK_S)
            beat += 1
            self._refresh_leader()
            if beat % round(HEARTBEAT_S / TICK_S) == 0:
                for peer in self.spec.peers:
                    if peer.name != self.name:
                        self.messenger.send(peer.name, wire.Heartbeat(sender=self.name))
            self.frontend.check()
            leader = self.leader_name
            if leader is not None:
                try:
                    await self.worker.pump_events()
                except Exception:
                    logger.exception("sending cache events failed")
            if self.router.active and beat % 5 == 0:
                self.router.check_liveness()

    def _register_metrics(self, app) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        peer = self

        class ClusterCollector:
            def collect(self):
                moved = CounterMetricFamily("nebula_kv_transfer_bytes", "KV bytes read from other peers (NIXL)")
                moved.add_metric([], peer.worker.transfer_bytes)
                yield moved
                failed = CounterMetricFamily("nebula_kv_transfer_failures", "KV reads that failed and were recomputed")
                failed.add_metric([], peer.worker.transfer_failures)
                yield failed
                evictions = CounterMetricFamily("nebula_cache_evictions", "Cache entries evicted from the device",
                                                labels=["kind"])
                for kind in ("pc", "pic"):
                    evictions.add_metric([kind], peer.worker.evictions[kind])
                yield evictions
                leader = GaugeMetricFamily("nebula_is_leader", "1 on the peer that runs the router")
                leader.add_metric([], 1.0 if peer.router.active else 0.0)
                yield leader
                if peer.router.active:
                    inflight = GaugeMetricFamily("nebula_router_in_flight", "Requests planned, combine not done")
                    inflight.add_metric([], len(peer.router.in_flight))
                    yield inflight

        app.state.metrics.register(ClusterCollector())


def settings_from_args(args: argparse.Namespace) -> PeerSettings:
    """Flags (files, timeouts) plus secrets from the environment."""
    access = EtcdAccess(args.etcd_ca_cert, args.etcd_cert, args.etcd_key, args.etcd_user,
                        os.environ.get(ETCD_PASSWORD_ENV) or None)
    return PeerSettings(cluster_secret(file=args.cluster_secret_file), os.environ.get(API_KEY_ENV) or None, access,
                        args.peer_timeout, args.failover_timeout, args.max_request_bytes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one nebula-engine cluster peer")
    parser.add_argument("--spec", required=True, help="cluster spec JSON file")
    parser.add_argument("--name", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name")
    parser.add_argument("--engine-options", default="{}", help="JSON object of EngineConfig.create options")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--cluster-secret-file", help="0600 file holding the cluster secret "
                                                      "(else $NEBULA_CLUSTER_SECRET)")
    parser.add_argument("--peer-timeout", type=float, default=PeerSettings.peer_timeout_s)
    parser.add_argument("--failover-timeout", type=float, default=PeerSettings.failover_timeout_s)
    parser.add_argument("--max-request-bytes", type=int, default=PeerSettings.max_request_bytes)
    for flag in ("--etcd-ca-cert", "--etcd-cert", "--etcd-key", "--etcd-user"):
        parser.add_argument(flag)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {args.name} %(levelname)s %(name)s: "
                                                              "%(message)s")
    spec = ClusterSpec.from_json(Path(args.spec).read_text())
    try:
        peer = Peer(spec, args.name, json.loads(args.engine_options), args.model,
                    args.served_model_name or args.model, settings_from_args(args))
    except (SecretError, ValueError) as error:
        parser.exit(2, f"peer {args.name}: {error}\n")
    asyncio.run(peer.run())
    os._exit(0)  # NIXL / UCX threads must not keep a stopped peer alive


if __name__ == "__main__":
    main()

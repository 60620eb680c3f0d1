"""One engine peer process of a cluster, and its composition root: builds the engine and its two ports (``KVPort``,
``RequestPort``: the only way any part of the peer reaches the engine), the data plane (worker, NIXL agent), the
router (active when elected), the election and the HTTP front end, wires them together and routes each incoming
message to the component that handles it.

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
from pathlib import Path

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.auth import SecretError, cluster_secret, derive_key
from nebula_engine.cluster.runtime.cost_profile import measured_cluster_config
from nebula_engine.cluster.runtime.election import ETCD_PASSWORD_ENV, ElectionSpec, EtcdAccess, make_election
from nebula_engine.cluster.runtime.frontend import ClusterFrontend
from nebula_engine.cluster.runtime.liveness import HEARTBEAT_S, Liveness
from nebula_engine.cluster.runtime.router import RouterService
from nebula_engine.cluster.runtime.spec import API_KEY_ENV, PORT_TAKEN_EXIT, ClusterSpec, PeerSettings, check_secured
from nebula_engine.cluster.runtime.status import add_cluster_route
from nebula_engine.cluster.runtime.transfer import KVTransferAgent, TransferError, confine_ucx_to
from nebula_engine.cluster.runtime.transport import Messenger
from nebula_engine.cluster.runtime.worker import WorkerService
from nebula_engine.engine.kv_port import KVPort
from nebula_engine.engine.request_port import RequestPort
from nebula_engine.ports import PortUnavailable, check_listen

logger = logging.getLogger(__name__)

TICK_S = 0.1
# A peer times its prefill at start-up while the other peers of a local cluster load too: within one default compare
# the four peers read 0.050 to 0.127 ms a token, and the leader 0.047 once idle. Planned with 0.12 ms, nebula's
# TTFT p99 was 2.58 s against 0.44 s with the 0.05 measured idle. So the leader times it again while the
# cluster is idle, after every peer has started, and keeps the fastest. Each timing holds its engine for three
# 256-token forwards (~40 ms on the default compare's model); five, a second apart, bound what that costs.
IDLE_TIMINGS = 5
IDLE_TIMING_GAP_S = 1.0


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
        self._greeted: set[str] = set()  # peers whose Hello arrived: they have started
        self.idle_timings = 0  # prefill timings taken while the cluster was idle (IDLE_TIMINGS)
        self._last_idle_timing = float("-inf")

    # ---- startup ----
    async def _build(self) -> None:
        from nebula_engine.config import EngineConfig
        from nebula_engine.engine.async_engine import AsyncLLMEngine

        options = {**self.engine_options, "worker_id": max(self.me.worker_index, 0)}
        engine = AsyncLLMEngine.from_config(EngineConfig.create(self.model, **options))
        self.kv, self.requests = KVPort(engine), RequestPort(engine)
        confine_ucx_to(self.me.host)
        self.agent = KVTransferAgent(self.name, self.kv.transfer_tensors())
        self.messenger = Messenger(self.name, f"tcp://{self.me.host}:{self.me.ctrl_port}",
                                   {p.name: p.ctrl_address for p in self.spec.peers if p.name != self.name},
                                   self.settings.cluster_secret)
        settings, peer_names = self.settings, [p.name for p in self.spec.peers]
        self.liveness = Liveness(self.name, peer_names, settings.peer_timeout_s)
        self.worker = WorkerService(self.name, self.me.role, self.me.worker_index, self.kv, self.requests,
                                    self.agent, self.send, lambda: self.leader_name, self._pic_key, self.liveness)
        per_token_s = await self.requests.prefill_seconds_per_token()
        logger.info("%s: prefill timed at start-up: %.4f ms a token", self.name, per_token_s * 1e3)
        config = measured_cluster_config(self.spec, self.kv.kv_geometry, per_token_s,
                                         lead_while_waiting=self.kv.combines_start_after_prefix,
                                         pic_backend=self.kv.pic_backend_name)
        self.router = RouterService(self.name, [p.name for p in self.spec.prefill_peers],
                                    [p.name for p in self.spec.decode_peers], config, self.spec.policy,
                                    self.send, self._pic_key, self.liveness,
                                    observe_transfers=self.spec.observe_transfer_costs)
        loop = asyncio.get_running_loop()
        self.election = make_election(self._election_spec(),
                                      on_change=lambda leader: loop.call_soon_threadsafe(self._refresh_leader))
        self.frontend = ClusterFrontend(self.name, self.requests, self.send, lambda: self.leader_name,
                                        lambda: self.election.has_quorum,
                                        [p.name for p in self.spec.prefill_peers], self.liveness,
                                        settings.failover_timeout_s, max_losses=len(peer_names))

    def _pic_key(self, spec: str | None, ids: list[int]) -> str:
        return self.kv.segment_key(spec, ids)

    def _election_spec(self) -> ElectionSpec:
        """etcd leases when the spec names an etcd, else Raft among the peers (authenticated by the cluster
        secret)."""
        if self.spec.etcd:
            return ElectionSpec(self.name, backend="etcd", etcd_endpoint=self.spec.etcd,
                                etcd_access=self.settings.etcd_access)
        secret = self.settings.cluster_secret
        return ElectionSpec(self.name, raft_peers={p.name: f"{p.host}:{p.raft_port}" for p in self.spec.peers},
                            raft_password=derive_key(secret, "raft/v1").hex() if secret else None)

    # ---- messaging ----
    def send(self, peer: str, message: wire.Msg) -> None:
        """The one send path of every part of this peer: to another peer over the transport, to itself in process."""
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
            case wire.ScatterLead():
                spawn(self.worker.on_scatter_lead(msg))
            case wire.Combine():
                spawn(self.worker.on_combine(msg))
            case wire.SnapshotRequest():
                spawn(self.worker.pump_events(snapshot=True))
            case wire.PCShare():
                spawn(self.kv.set_pc_share(msg.pc_share))
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
        self._greeted.add(msg.sender)
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

        from nebula_engine.cluster.runtime.metrics import ClusterCollector
        from nebula_engine.server.api import build_app

        await self._build()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stopping.set)
        for peer in self.spec.peers:
            if peer.name != self.name:
                self.messenger.send(peer.name, self._hello(reply=False))
        self.election.start()
        app = build_app(self.frontend, self.served_model_name, api_key=self.settings.api_key,
                        max_request_bytes=self.settings.max_request_bytes)
        app.state.metrics.register(ClusterCollector(self.worker, self.router, self.served_model_name))
        add_cluster_route(app, self)
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
            self.requests.shutdown()
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
            await self._time_prefill_when_idle()

    async def _time_prefill_when_idle(self) -> None:
        """On the leader, once every peer has started and no request is in flight: time this engine's prefill
        again and plan with it if it is faster (``IDLE_TIMINGS``)."""
        now = asyncio.get_running_loop().time()
        if (not self.router.active or self.router.in_flight or self.idle_timings >= IDLE_TIMINGS
                or now - self._last_idle_timing < IDLE_TIMING_GAP_S
                or len(self._greeted) < len(self.spec.peers) - 1):
            return
        self.idle_timings += 1
        self._last_idle_timing = now
        try:
            self.router.faster_prefill_timed(await self.requests.prefill_seconds_per_token())
        except Exception:
            logger.exception("timing the prefill failed")


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
        for host, port, kind in spec.listen_addresses(args.name):  # before the model loads: a taken port fails fast
            check_listen(host, port, kind)
    except PortUnavailable as error:
        parser.exit(PORT_TAKEN_EXIT, f"peer {args.name}: {error}\n")
    except ValueError as error:
        parser.exit(2, f"peer {args.name}: {error}\n")
    try:
        peer = Peer(spec, args.name, json.loads(args.engine_options), args.model,
                    args.served_model_name or args.model, settings_from_args(args))
    except (SecretError, ValueError) as error:
        parser.exit(2, f"peer {args.name}: {error}\n")
    asyncio.run(peer.run())
    os._exit(0)  # NIXL / UCX threads must not keep a stopped peer alive


if __name__ == "__main__":
    main()

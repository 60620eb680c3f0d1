"""``GET /cluster``: one peer's view of the cluster, for operators and tests (``LocalCluster.state`` reads it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nebula_engine.engine.port_types import EngineDeadError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from nebula_engine.cluster.runtime.peer import Peer


def add_cluster_route(app: FastAPI, peer: Peer) -> None:
    @app.get("/cluster")
    async def cluster_state() -> dict:
        """This peer's view of the cluster (for operators and tests)."""
        return await peer_state(peer)


async def peer_state(peer: Peer) -> dict:
    """Who leads, what this peer's engine, router, worker and front end are doing, and its PIC counters."""
    load, router, worker = peer.requests.stats(), peer.router, peer.worker
    try:
        pic = await peer.kv.pic_stats()
    except EngineDeadError:
        pic = {}
    return {"name": peer.name, "role": peer.me.role, "leader": peer.leader_name,
            "quorum": peer.election.has_quorum, "dropped_frames": peer.messenger.num_dropped,
            "engine": {"running": load.num_running, "waiting": load.num_waiting},
            "router": {"active": router.active, "in_flight": len(router.in_flight), "planned": router.num_planned,
                       "lost": router.num_lost, "dead": sorted(router.dead),
                       "prefill_ms_per_token": router.config.profile.prefill.per_token_s * 1e3,
                       "idle_prefill_timings": peer.idle_timings},
            "transfer_bytes": worker.transfer_bytes, "read_bytes": worker.read_bytes, "read_tokens": worker.read_tokens,
            "transfer_failures": worker.transfer_failures,
            "lead_tokens_prefilled": worker.lead_tokens_prefilled, "leads_for_others": worker.leads_for_others,
            "resubmitted": peer.frontend.num_resubmitted, "nixl_peers": sorted(peer.agent.peers), "pic": pic}

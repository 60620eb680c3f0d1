"""The planner's cost model for a cluster of peers on this machine: the engine's real KV size and prefill speed,
NIXL over loopback, and the machine's cores shared by every peer."""

from __future__ import annotations

from dataclasses import replace

import torch

from nebula_engine.cluster.control.config import ClusterConfig, ClusterProfile, TransferLink
from nebula_engine.cluster.runtime.spec import ClusterSpec
from nebula_engine.devices import machine_cores
from nebula_engine.engine.port_types import KVGeometry

LOOPBACK_BANDWIDTH_BYTES_PER_S = 1.0e9  # what NIXL moves between two local peers, about
PREFILL_FIXED_S = 0.01


def measured_cluster_config(spec: ClusterSpec, kv: KVGeometry, prefill_per_token_s: float,
                            lead_while_waiting: bool = True, pic_backend: str | None = None) -> ClusterConfig:
    """``ClusterProfile.load()`` with this engine's KV geometry and ``prefill_per_token_s`` (measured with
    ``RequestPort.prefill_seconds_per_token``); every link is loopback. A read's fixed cost (the pin round
    trip and the insert) is the spec's ``remote_read_latency_s``, paid once per source (``TransferCosts.latency``);
    a segment scattered to another peer also pays its ``scatter_dispatch_s`` (``TransferCosts.dispatch``).

    Peers of a spec that stays on this machine share its cores (``shared_compute``, unless the spec's
    ``shared_cores`` is off): ``node_cores`` is then how many peers compute at once at the measured speed, this
    machine's cores over this peer's torch threads (the default compare: 2 cores, 1 thread, so 2 of its 4 peers).
    A spec spanning machines keeps one processor per peer.

    A peer's engine runs its work in arrival order, so a combine waits behind its home's queue even when every cold
    segment is computed elsewhere (``combine_queues``; the paper's model gives a combine priority instead), and a
    home whose combine waits for remote KV prefills the prompt's lead meanwhile (``lead_while_waiting``, the
    worker's ``_prefill_lead``: pass False for an engine whose combines do not start after a cached prefix). A pin
    on a segment its holder has not computed yet waits for that holder's queue, so an expected copy is planned with
    that wait (``expected_copies_wait``).

    ``pic_backend``: the name of the backend the peers' engines run (``LLMEngine.pic_backend``); a combine is then
    planned at that backend's measured cost per reused token (the profile's ``combine_cost``), not at the cost of
    the profile's own backend. None (PIC off) keeps the profile's."""
    base = ClusterProfile.load()
    if pic_backend is not None:
        if pic_backend not in base.combine_cost:
            raise ValueError(f"profile {base.name!r} has no combine cost for PIC backend {pic_backend!r}; measured: "
                             f"{', '.join(sorted(base.combine_cost))} (tools/combine_costs.py measures them)")
        base = replace(base, pic_backend=pic_backend)
    loopback = TransferLink(bandwidth_bytes_per_s=LOOPBACK_BANDWIDTH_BYTES_PER_S, latency_s=spec.remote_read_latency_s)
    profile = replace(base, name="local-cpu", kv_bytes_per_token=max(1, kv.bytes_per_token), intra_node=loopback,
                      inter_node=loopback, gpus_per_node=len(spec.peers),
                      cache_capacity_tokens=kv.num_pages * kv.page_size, dispatch_s=spec.scatter_dispatch_s,
                      shared_compute=spec.shared_cores and not spec.spans_machines, combine_queues=True,
                      lead_while_waiting=lead_while_waiting, expected_copies_wait=True,
                      node_cores=max(1.0, machine_cores() / torch.get_num_threads()),
                      prefill=replace(base.prefill, per_token_s=prefill_per_token_s, fixed_s=PREFILL_FIXED_S))
    return ClusterConfig(num_prefill_workers=len(spec.prefill_peers), profile=profile)

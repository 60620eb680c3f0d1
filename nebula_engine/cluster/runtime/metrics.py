"""Prometheus metrics of one peer, served on its front end's ``/metrics`` next to the engine's own."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nebula_engine.cluster.runtime.router import RouterService
from nebula_engine.cluster.runtime.worker import WorkerService


READ_KINDS = ("prefix", "pic", "handoff")  # what a peer reads from another: reused KV, a prefilled request's KV


class ClusterCollector:
    """KV moved between peers and the reads that failed, device evictions, and (on the leader) router load."""

    def __init__(self, worker: WorkerService, router: RouterService, model_name: str = ""):
        self.worker = worker
        self.router = router
        self.model_name = model_name

    def collect(self):
        read_bytes, read_tokens = self.worker.read_bytes, self.worker.read_tokens
        remote_bytes = CounterMetricFamily("nebula:kv_remote_read_bytes", "KV bytes read from other peers, by what "
                                           "was read: prefix or pic (reused KV), handoff (a prefilled request's KV)",
                                           labels=["model_name", "kind"])
        remote_tokens = CounterMetricFamily("nebula:kv_remote_read_tokens", "Tokens whose KV was read from other "
                                            "peers, by what was read (prefix, pic, handoff)",
                                            labels=["model_name", "kind"])
        for kind in READ_KINDS:
            remote_bytes.add_metric([self.model_name, kind], read_bytes.get(kind, 0))
            remote_tokens.add_metric([self.model_name, kind], read_tokens.get(kind, 0))
        yield remote_bytes
        yield remote_tokens
        moved = CounterMetricFamily("nebula_kv_transfer_bytes", "KV bytes read from other peers (NIXL)")
        moved.add_metric([], self.worker.transfer_bytes)
        yield moved
        failed = CounterMetricFamily("nebula_kv_transfer_failures", "KV reads that failed and were recomputed")
        failed.add_metric([], self.worker.transfer_failures)
        yield failed
        leads = CounterMetricFamily("nebula_lead_tokens_prefilled", "Prompt tokens before the first PIC segment "
                                    "prefilled while combines waited for KV, here or for another peer")
        leads.add_metric([], self.worker.lead_tokens_prefilled)
        yield leads
        evictions = CounterMetricFamily("nebula_cache_evictions", "Cache entries evicted from the device",
                                        labels=["kind"])
        counts = self.worker.evictions
        for kind, entries in (("pc", counts.pc), ("pic", counts.pic)):
            evictions.add_metric([kind], entries)
        yield evictions
        leader = GaugeMetricFamily("nebula_is_leader", "1 on the peer that runs the router")
        leader.add_metric([], 1.0 if self.router.active else 0.0)
        yield leader
        if self.router.active:
            in_flight = GaugeMetricFamily("nebula_router_in_flight", "Requests planned, combine not done")
            in_flight.add_metric([], len(self.router.in_flight))
            yield in_flight

"""The router's control plane: view + cache manager + policy, driven by requests and worker events.

The simulator and the networked router both call exactly this. Pure logic: ``now`` is an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

from nebula_engine.cluster.cache_manager import CacheManager
from nebula_engine.cluster.config import ClusterConfig
from nebula_engine.cluster.messages import Action, CacheKind, PrefillPlan, WorkerEvent
from nebula_engine.cluster.planner import TransferCosts
from nebula_engine.cluster.policies import make_policy, view_config
from nebula_engine.cluster.request_keys import RequestKeys
from nebula_engine.cluster.view import ClusterView


@dataclass(frozen=True)
class Decision:
    plan: PrefillPlan
    pc_share: float | None  # the new p to broadcast to workers, when this request closed a window


class ControlPlane:
    def __init__(self, config: ClusterConfig, policy: str = "nebula", view: str | None = None,
                 scheduler: str = "greedy", costs: TransferCosts | None = None):
        self.config = config
        self.costs = costs or TransferCosts.from_profile(config.profile, config.num_prefill_workers)
        self.policy = make_policy(policy, config, self.costs, scheduler)
        self.cache_manager = CacheManager(config.cache_manager)
        self.view_name = view or self.policy.default_view
        self.view = ClusterView(config.num_prefill_workers, view_config(self.view_name, config),
                                listener=self.cache_manager.on_presence)

    def on_request(self, keys: RequestKeys, now: float) -> Decision:
        """Plan one request (FIFO order), record it in the view, and feed the cache manager."""
        self.view.expire(now)
        pc_share = self.cache_manager.observe(keys)
        plan = self.policy.plan(keys, self.view, now)
        self.view.record_dispatch(plan, now)
        self._touch_reused(plan)
        return Decision(plan, pc_share)

    def on_event(self, event: WorkerEvent, now: float) -> bool:
        self.view.expire(now)
        return self.view.apply(event, now)

    def _touch_reused(self, plan: PrefillPlan) -> None:
        for segment in plan.segments:
            if segment.action is Action.REUSE:
                self.view.touch(CacheKind.PIC, segment.key, segment.worker)

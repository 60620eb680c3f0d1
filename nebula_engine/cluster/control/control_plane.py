"""The router's control plane: view + cache manager + policy, driven by requests and worker events.

The simulator and the networked router both call exactly this. Pure logic: ``now`` is an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

from nebula_engine.cluster.control.cache_manager import CacheManager
from nebula_engine.cluster.control.config import ClusterConfig
from nebula_engine.cluster.control.messages import (Action, CacheKind, PrefillPlan, PrefixPlan, SegmentPlan, Tier,
                                            WorkerEvent)
from nebula_engine.cluster.control.planner import Hit, TransferCosts, hit_source, readable_copies
from nebula_engine.cluster.control.policies import NebulaPolicy, make_policy, view_config
from nebula_engine.cluster.control.request_keys import RequestKeys
from nebula_engine.cluster.control.view import ClusterView


@dataclass(frozen=True)
class Decision:
    plan: PrefillPlan
    pc_share: float | None  # the device tier's new p to broadcast to workers, when this request closed a window
    tier_shares: dict[Tier, float] | None = None  # every tier's new p (§6.2), with pc_share


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

    def set_costs(self, costs: TransferCosts) -> None:
        """Plan from now on with ``costs`` (``ObservedTransferCosts``: what transfers take at the current load)."""
        self.costs = costs
        self.policy.set_costs(costs)

    def on_request(self, keys: RequestKeys, now: float, home: int | None = None) -> Decision:
        """Plan one request (FIFO order), record it in the view, and feed the cache manager.

        ``home``: the combine must run on this worker (an operator's or a test's choice); the policy still
        decides where each PIC segment comes from."""
        self.view.expire(now)
        shares = self.cache_manager.observe(keys)
        plan = self.policy.plan(keys, self.view, now) if home is None else self.pinned_plan(keys, home, now)
        self.view.record_dispatch(plan, now)
        self._touch_reused(plan)
        return Decision(plan, None if shares is None else shares[Tier.DEVICE], shares)

    def pinned_plan(self, keys: RequestKeys, home: int, now: float) -> PrefillPlan:
        """A plan whose combine runs on ``home``: the prefix it holds is reused (``nebula``: or a deeper one that
        another worker holds, read from there when that beats recomputing it); with PIC, each segment past it
        is read from the holder cheapest to move to ``home`` (when reading it pays: ``readable_copies``) or computed at
        ``home``; a segment repeated inside the request is planned once."""
        depths = self.view.prefix_matches(keys.pc_keys, now)
        holder, depth = home, depths.get(home, 0)
        if self.policy.name == "nebula":
            deepest = max(depths.items(), key=lambda item: (item[1], item[0] == home), default=(home, 0))
            extra_tokens = keys.prefix_tokens(deepest[1]) - keys.prefix_tokens(depth)
            if deepest[1] > depth and self.costs.load_beats_recompute(Tier.DEVICE, deepest[0], home, extra_tokens):
                holder, depth = deepest
        prefix = PrefixPlan(holder, depth, keys.prefix_tokens(depth)) if depth else None
        readable = self._pinned_readable(keys, home, depth, now)
        segments, placed = [], {}
        for index in keys.pic_indices if self.policy.name != "pc" else ():
            if index < depth:
                continue
            key, tokens = keys.content_ids[index], keys.tokens[index]
            if self.policy.name == "local-pic":
                segments.append(SegmentPlan(index, key, tokens, home, Action.LOCAL))
            elif key in placed:
                first = placed[key]
                segments.append(SegmentPlan(index, key, tokens, first.worker, Action.REUSE, tier=first.tier))
            else:
                copies = readable.get(key)
                if copies:
                    source = hit_source(Hit(tokens, copies), home, self.costs)
                    tier = next(t for w, t in copies if w == source)
                    placed[key] = SegmentPlan(index, key, tokens, source, Action.REUSE, tier=tier)
                else:
                    placed[key] = SegmentPlan(index, key, tokens, home, Action.COMPUTE,
                                              task_id=f"{keys.request_id}/scatter/{index}")
                segments.append(placed[key])
        return PrefillPlan(request_id=keys.request_id, combine_home=home, combine_task_id=f"{keys.request_id}/combine",
                           combine_tokens=keys.total_tokens - keys.prefix_tokens(depth), prefix=prefix,
                           segments=tuple(segments), pc_keys=keys.pc_keys, segment_tokens=keys.tokens)

    def _pinned_readable(self, keys: RequestKeys, home: int, depth: int, now: float) -> dict:
        """``nebula``: per PIC content past the prefix, the copies ``home`` reads (``readable_copies``)."""
        if self.policy.name != "nebula":
            return {}
        holders, length, wait = NebulaPolicy.copies_past(keys, self.view, depth, now,
                                                         self.costs.expected_copies_wait)
        return readable_copies(holders, length, home, self.costs, wait, self.view.outstanding_tokens(home))

    def on_event(self, event: WorkerEvent, now: float) -> bool:
        self.view.expire(now)
        return self.view.apply(event, now)

    def _touch_reused(self, plan: PrefillPlan) -> None:
        for segment in plan.segments:
            if segment.action is Action.REUSE:
                self.view.touch(CacheKind.PIC, segment.key, segment.worker)

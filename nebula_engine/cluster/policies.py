"""Cluster policies compared in the paper, one interface, selected by the names users type.

``pc``: prefix-cache-aware routing like Dynamo's (cost = tokens left to prefill + outstanding load),
no PIC. ``local-pic``: the same router in front of PIC-enabled workers that only reuse their own
copies. ``nebula``: remote PIC reuse and parallel prefill planned by a scheduler (``greedy`` is
Algorithm 1; ``locality`` / ``load`` are the §7.1 strawmen). View and cache variants are configs.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import replace

from nebula_engine.cluster.config import ClusterConfig, ViewConfig
from nebula_engine.cluster.messages import (Action, CacheKind, PrefillPlan, PrefixPlan, SegmentPlan,
                                            Tier)
from nebula_engine.cluster.planner import Hit, PlanningProblem, TransferCosts
from nebula_engine.cluster.request_keys import RequestKeys
from nebula_engine.cluster.schedulers import SCHEDULERS
from nebula_engine.cluster.view import ClusterView


class Policy(ABC):
    """Given a request's keys and the view at ``now``, return a plan. Only reads the view (and
    lets it drop expired records on the way); recording the plan is the control plane's job."""

    name: str = ""
    default_view: str = "nebula"

    def __init__(self, config: ClusterConfig, costs: TransferCosts, scheduler: str = "greedy"):
        self.config = config
        self.costs = costs
        self.rng = random.Random(config.seed)
        self.recompute_ratio = config.profile.pic_recompute_ratio

    @abstractmethod
    def plan(self, keys: RequestKeys, view: ClusterView, now: float) -> PrefillPlan:
        ...

    def _build(self, keys: RequestKeys, home: int, prefix: PrefixPlan | None,
               segments: tuple[SegmentPlan, ...], combine_tokens: float, estimate: float = 0.0):
        return PrefillPlan(request_id=keys.request_id, combine_home=home,
                           combine_task_id=f"{keys.request_id}/combine", combine_tokens=combine_tokens,
                           prefix=prefix, segments=segments, pc_keys=keys.pc_keys,
                           segment_tokens=keys.tokens, estimate=estimate)


class PrefixAwarePolicy(Policy):
    """Dynamo-style KV-aware routing: the worker minimising uncached prefill tokens + its load."""

    name = "pc"
    default_view = "event"

    def route(self, keys: RequestKeys, view: ClusterView, now: float) -> tuple[int, int]:
        """(worker, prefix segments it already holds); ties broken uniformly at random."""
        depths = view.prefix_matches(keys.pc_keys, now)
        costs = [keys.total_tokens - keys.prefix_tokens(depths.get(w, 0)) + view.outstanding_tokens(w)
                 for w in range(view.num_workers)]
        best = min(costs)
        ties = [w for w, c in enumerate(costs) if c == best]
        worker = ties[0] if len(ties) == 1 else self.rng.choice(ties)
        return worker, depths.get(worker, 0)

    def plan(self, keys: RequestKeys, view: ClusterView, now: float) -> PrefillPlan:
        home, depth = self.route(keys, view, now)
        prefix = PrefixPlan(home, depth, keys.prefix_tokens(depth)) if depth else None
        return self._build(keys, home, prefix, (), keys.total_tokens - keys.prefix_tokens(depth))


class LocalPicPolicy(PrefixAwarePolicy):
    """PIC-enabled workers behind the prefix-aware router: each PIC segment past the prefix is
    reused if the home itself holds it, else computed there (the router cannot see PIC copies)."""

    name = "local-pic"

    def plan(self, keys: RequestKeys, view: ClusterView, now: float) -> PrefillPlan:
        home, depth = self.route(keys, view, now)
        prefix = PrefixPlan(home, depth, keys.prefix_tokens(depth)) if depth else None
        segments = tuple(SegmentPlan(i, keys.content_ids[i], keys.tokens[i], home, Action.LOCAL)
                         for i in keys.pic_indices if i >= depth)
        return self._build(keys, home, prefix, segments, keys.total_tokens - keys.prefix_tokens(depth))


class NebulaPolicy(Policy):
    """Remote PIC reuse + parallel prefill: the scheduler places every piece of the request."""

    name = "nebula"

    def __init__(self, config: ClusterConfig, costs: TransferCosts, scheduler: str = "greedy"):
        super().__init__(config, costs)
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {scheduler!r}; choose from {sorted(SCHEDULERS)}")
        self.scheduler = SCHEDULERS[scheduler](costs, config.seed)

    def plan(self, keys: RequestKeys, view: ClusterView, now: float) -> PrefillPlan:
        depths = view.prefix_matches(keys.pc_keys, now)
        depth = max(depths.values(), default=0)
        hits, hit_index, cold, cold_index = [], [], [], []
        if depth:
            holders = tuple((w, Tier.DEVICE) for w, d in sorted(depths.items()) if d == depth)
            hits.append(Hit(keys.prefix_tokens(depth), holders))
            hit_index.append(-1)
        combine = sum(keys.tokens[depth:]) - sum(keys.tokens[i] for i in keys.pic_indices if i >= depth)
        first_of: dict[str, int] = {}  # a segment repeated inside the request is placed once
        for i in keys.pic_indices:
            if i < depth:
                continue
            combine += self.recompute_ratio * keys.tokens[i]
            if first_of.setdefault(keys.content_ids[i], i) != i:
                continue
            holders = self._usable_holders(view, keys.content_ids[i], now)
            if holders:
                hits.append(Hit(keys.tokens[i], holders))
                hit_index.append(i)
            else:
                cold.append(keys.tokens[i])
                cold_index.append(i)
        problem = PlanningProblem(tuple(hits), tuple(cold), tuple(view.outstanding()), combine)
        placed = self.scheduler.place(problem)
        plan = self._to_plan(keys, placed, problem, hit_index, cold_index, depth)
        return self._with_repeats(plan, keys, first_of)

    def _usable_holders(self, view: ClusterView, key: str, now: float) -> tuple[tuple[int, Tier], ...]:
        """Holders worth reading from: a slow-tier copy only if loading it beats recomputing."""
        found = sorted(view.holders(CacheKind.PIC, key, now).items())
        return tuple((w, r.tier) for w, r in found
                     if r.tier is Tier.DEVICE or self.costs.load_beats_recompute(r.tier, w, w))

    def _to_plan(self, keys, placed, problem, hit_index, cold_index, depth) -> PrefillPlan:
        home, prefix, segments = placed.home, None, []
        for index, hit, src in zip(hit_index, problem.hits, placed.hit_sources):
            tier = next(t for w, t in hit.holders if w == src)
            if index < 0:
                prefix = PrefixPlan(src, depth, hit.num_tokens)
            else:
                segments.append(SegmentPlan(index, keys.content_ids[index], keys.tokens[index], src,
                                            Action.REUSE, tier=tier))
        for index, worker in zip(cold_index, placed.cold_workers):
            segments.append(SegmentPlan(index, keys.content_ids[index], keys.tokens[index], worker,
                                        Action.COMPUTE, task_id=f"{keys.request_id}/s{index}"))
        segments.sort(key=lambda s: s.index)
        return self._build(keys, home, prefix, tuple(segments), problem.combine_cost, placed.estimate)


    @staticmethod
    def _with_repeats(plan: PrefillPlan, keys: RequestKeys, first_of: dict[str, int]) -> PrefillPlan:
        """Later copies of a segment reuse the first copy's KV from wherever the plan puts it."""
        repeats = [i for i in keys.pic_indices if first_of.get(keys.content_ids[i], i) != i]
        if not repeats:
            return plan
        placed = {s.index: s for s in plan.segments}
        extra = []
        for i in repeats:
            first = placed[first_of[keys.content_ids[i]]]
            extra.append(SegmentPlan(i, first.key, first.num_tokens, first.worker, Action.REUSE, tier=first.tier))
        return replace(plan, segments=tuple(sorted(plan.segments + tuple(extra), key=lambda s: s.index)))


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (PrefixAwarePolicy, LocalPicPolicy, NebulaPolicy)}


def view_config(name: str, config: ClusterConfig) -> ViewConfig:
    """View variants of §5.1 / §9.3 by name."""
    ttl = config.view.unconfirmed_ttl_s
    variants = {
        "nebula": replace(config.view, record_on_dispatch=True, apply_cache_events=True),
        "optimistic": ViewConfig(record_on_dispatch=True, apply_cache_events=False, unconfirmed_ttl_s=None,
                                 modelled_capacity_tokens=config.profile.cache_capacity_tokens),
        "event": ViewConfig(record_on_dispatch=False, apply_cache_events=True, unconfirmed_ttl_s=ttl),
    }
    if name not in variants:
        raise ValueError(f"unknown view {name!r}; choose from {sorted(variants)}")
    return variants[name]


VIEWS = ("nebula", "optimistic", "event")
CACHES = {"self-tuning": "soft-share", "unified-lru": "unified-lru", "fixed-partition": "fixed-partition"}


def make_policy(name: str, config: ClusterConfig, costs: TransferCosts, scheduler: str = "greedy") -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name](config, costs, scheduler)

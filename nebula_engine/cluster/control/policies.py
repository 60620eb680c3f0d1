"""Cluster policies compared in the paper, one interface, selected by the names users type.

``pc``: prefix-cache-aware routing like Dynamo's (cost = tokens left to prefill + outstanding load),
no PIC. ``local-pic``: the same router in front of PIC-enabled workers that only reuse their own
copies. ``nebula``: remote PIC reuse and parallel prefill planned by a scheduler (``greedy`` is
Algorithm 1; ``locality`` / ``load`` are the §7.1 strawmen). View and cache variants are configs.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import replace

from nebula_engine.cluster.control.config import ClusterConfig, ViewConfig
from nebula_engine.cluster.control.messages import (Action, CacheKind, LeadPlan, PrefillPlan, PrefixPlan,
                                                    SegmentPlan, Tier)
from nebula_engine.cluster.control.planner import (NO_WORKER_UP, Hit, PlanningProblem, TransferCosts, break_tie,
                                                   readable_copies)
from nebula_engine.cluster.control.request_keys import RequestKeys
from nebula_engine.cluster.control.schedulers import SCHEDULERS
from nebula_engine.cluster.control.view import ClusterView


class Policy(ABC):
    """Given a request's keys and the view at ``now``, return a plan. Only reads the view (and
    lets it drop expired records on the way); recording the plan is the control plane's job."""

    name: str = ""
    default_view: str = "nebula"
    default_cache: str = "self-tuning"  # workers' eviction rule when the caller names none

    def __init__(self, config: ClusterConfig, costs: TransferCosts, scheduler: str = "greedy"):
        self.config = config
        self.costs = costs
        self.rng = random.Random(config.seed)
        self.combine_ratio = config.profile.combine_ratio

    @abstractmethod
    def plan(self, keys: RequestKeys, view: ClusterView, now: float) -> PrefillPlan:
        ...

    def set_costs(self, costs: TransferCosts) -> None:
        self.costs = costs

    def _build(self, keys: RequestKeys, home: int, prefix: PrefixPlan | None,
               segments: tuple[SegmentPlan, ...], combine_tokens: float, estimate: float = 0.0,
               lead: LeadPlan | None = None):
        return PrefillPlan(request_id=keys.request_id, combine_home=home,
                           combine_task_id=f"{keys.request_id}/combine", combine_tokens=combine_tokens,
                           prefix=prefix, segments=segments, pc_keys=keys.pc_keys,
                           segment_tokens=keys.tokens, estimate=estimate, lead=lead)


class PrefixAwarePolicy(Policy):
    """Dynamo-style KV-aware routing: the worker minimising uncached prefill tokens + its load."""

    name = "pc"
    default_view = "event"
    default_cache = "unified-lru"  # SGLang's radix cache: plain LRU over every entry, no PC/PIC share

    def route(self, keys: RequestKeys, view: ClusterView, now: float) -> tuple[int, int]:
        """(worker, prefix segments it already holds); ties broken uniformly at random."""
        depths = view.prefix_matches(keys.pc_keys, now)
        costs = [keys.total_tokens - keys.prefix_tokens(depths.get(w, 0)) + view.outstanding_tokens(w)
                 for w in range(view.num_workers)]
        best = min(costs)
        if best == math.inf:
            raise ValueError(NO_WORKER_UP)
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


LEAD_INDEX = -2  # the lead's place among a problem's cold items (-1 marks the prefix among its hits)


class NebulaPolicy(Policy):
    """Remote PIC reuse + parallel prefill: the scheduler places every piece of the request.

    With ``TransferCosts.lead_while_waiting``, the prompt's lead (``lead``) is the home's own work, or, when every
    worker up holds the prefix hit, a cold item like a PIC segment: a helper then prefills it exactly after that
    prefix and the home reads its pages (``PrefillPlan.lead``)."""

    name = "nebula"

    def __init__(self, config: ClusterConfig, costs: TransferCosts, scheduler: str = "greedy"):
        super().__init__(config, costs)
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {scheduler!r}; choose from {sorted(SCHEDULERS)}")
        self.scheduler = SCHEDULERS[scheduler](costs, config.seed)

    def set_costs(self, costs: TransferCosts) -> None:
        super().set_costs(costs)
        self.scheduler.set_costs(costs)

    def plan(self, keys: RequestKeys, view: ClusterView, now: float) -> PrefillPlan:
        depths = view.prefix_matches(keys.pc_keys, now)
        depth = max(depths.values(), default=0)
        prefix_holders = tuple((w, Tier.DEVICE) for w, d in sorted(depths.items()) if d == depth)
        holders, length, wait = self.copies_past(keys, view, depth, now, self.costs.expected_copies_wait)
        queues = view.outstanding()
        up = [w for w, queue in enumerate(queues) if queue < math.inf]
        if not up:
            raise ValueError(NO_WORKER_UP)
        # the lead moves only where its prefix is: a helper without it would prefill the prefix too
        lead_movable = all(depths.get(w, 0) == depth for w in up)
        readable = {home: readable_copies(holders, length, home, self.costs, wait, queues[home]) for home in up}
        if all(copies == holders for copies in readable.values()):  # every copy pays: Algorithm 1 over all homes
            problem, hit_index, cold_index = self._problem(keys, view, depth, prefix_holders, holders, wait,
                                                           lead_movable)
            placed = self.scheduler.place(problem)
        else:
            problem, hit_index, cold_index, placed = self._best_home(keys, view, depth, prefix_holders, readable,
                                                                     wait, lead_movable)
        plan = self._to_plan(keys, placed, problem, hit_index, cold_index, depth)
        return self._with_repeats(plan, keys, depth)

    def _best_home(self, keys, view, depth, prefix_holders, readable, wait, lead_movable):
        """Plan once per home with the hits that home would read, and keep the lowest estimate (ties: the least
        loaded homes, then the seeded RNG, as the planner breaks them). A copy's worth depends on the home, so one
        problem cannot hold it."""
        best, ties = math.inf, []
        for home in sorted(readable):
            problem, hit_index, cold_index = self._problem(keys, view, depth, prefix_holders, readable[home], wait,
                                                           lead_movable)
            placed = self.scheduler.place(problem, homes=(home,))
            if placed.estimate < best:
                best, ties = placed.estimate, [(problem, hit_index, cold_index, placed)]
            elif placed.estimate == best:
                ties.append((problem, hit_index, cold_index, placed))
        return break_tie(ties, lambda tie: tie[3].home, ties[0][0].outstanding, self.rng)

    @staticmethod
    def copies_past(keys: RequestKeys, view: ClusterView, depth: int, now: float,
                    expected_copies_wait: bool = False) -> tuple[dict, dict, dict]:
        """Per PIC content past the prefix hit (its first occurrence): the copies a plan may read (worker, tier), by
        worker, its tokens, and, with ``expected_copies_wait``, for a content whose copies do not exist yet, how long
        their holder works before they do (``ClusterView.wait_tokens``). Copies that exist (or should by now) are
        then the ones read; with none, only the expected copy that waits least (then the lowest worker id), so that
        a waited-for copy has one holder whatever the home (``PlanningProblem.source_wait``). Without it, every live
        copy, as if it were stored (the paper's optimistic accounting)."""
        holders, length, wait = {}, {}, {}
        for i in keys.pic_indices:
            content = keys.content_ids[i]
            if i >= depth and content not in holders:
                copies = [(view.wait_tokens(record, w) if expected_copies_wait else 0.0, w, record.tier)
                          for w, record in sorted(view.holders(CacheKind.PIC, content, now).items())]
                ready = [(w, tier) for waits, w, tier in copies if waits == 0.0]
                if ready or not copies:
                    holders[content] = tuple(ready)
                else:
                    waits, w, tier = min(copies)
                    holders[content], wait[content] = ((w, tier),), waits
                length[content] = keys.tokens[i]
        return holders, length, wait

    def combine_cost(self, keys: RequestKeys, depth: int) -> float:
        """C of §7.2 in prefill tokens: the regular tokens past the prefix, plus the backend's combine cost of
        every PIC token past it (measured per backend: ``ClusterProfile.combine_cost``)."""
        pic = set(keys.pic_indices)
        return sum(keys.tokens[i] * (self.combine_ratio if i in pic else 1.0) for i in range(depth, len(keys.tokens)))

    def lead(self, keys: RequestKeys, depth: int) -> float:
        """The prompt's lead in prefill tokens when the home prefills it while it waits for remote KV
        (``TransferCosts.lead_while_waiting``; else 0): the regular tokens past the prefix hit before the first PIC
        segment. None of them is cached anywhere (the hit is the deepest), so some worker computes them."""
        first_pic = keys.pic_indices[0] if keys.pic_indices else 0
        if not self.costs.lead_while_waiting or first_pic <= depth:
            return 0.0
        return float(keys.prefix_tokens(first_pic) - keys.prefix_tokens(depth))

    def _problem(self, keys, view, depth, prefix_holders, holders, wait, lead_movable=False):
        hits, hit_index, cold, cold_index = [], [], [], []
        outstanding = view.outstanding()
        source_wait = [0.0] * len(outstanding)
        if depth:
            hits.append(Hit(keys.prefix_tokens(depth), prefix_holders))
            hit_index.append(-1)
        seen = set()
        for i in keys.pic_indices:
            content = keys.content_ids[i]
            if i < depth or content in seen:
                continue  # a segment repeated inside the request is placed once
            seen.add(content)
            if holders[content]:
                hits.append(Hit(keys.tokens[i], holders[content]))
                hit_index.append(i)
                if content in wait:  # one holder (copies_past)
                    src = holders[content][0][0]
                    source_wait[src] = max(source_wait[src], wait[content])
            else:
                cold.append(keys.tokens[i])
                cold_index.append(i)
        combine, lead = self.combine_cost(keys, depth), self.lead(keys, depth)
        if lead and lead_movable:  # placed like a cold segment; the combine computes what follows it
            cold.append(int(lead))
            cold_index.append(LEAD_INDEX)
            combine, lead = combine - lead, 0.0
        problem = PlanningProblem(tuple(hits), tuple(cold), tuple(outstanding), combine, lead,
                                  tuple(source_wait) if any(source_wait) else ())
        return problem, hit_index, cold_index

    def _to_plan(self, keys, placed, problem, hit_index, cold_index, depth) -> PrefillPlan:
        home, prefix, segments = placed.home, None, []
        for index, hit, src in zip(hit_index, problem.hits, placed.hit_sources):
            tier = next(t for w, t in hit.holders if w == src)
            if index < 0:
                prefix = PrefixPlan(src, depth, hit.num_tokens)
            else:
                segments.append(SegmentPlan(index, keys.content_ids[index], keys.tokens[index], src,
                                            Action.REUSE, tier=tier))
        lead, combine_tokens = None, problem.combine_cost
        for index, worker, tokens in zip(cold_index, placed.cold_workers, problem.cold):
            if index == LEAD_INDEX and worker == home:
                combine_tokens += tokens  # the home prefills it: in the combine, or while it waits for remote KV
            elif index == LEAD_INDEX:
                lead = LeadPlan(worker, tokens, f"{keys.request_id}/lead")
            else:
                segments.append(SegmentPlan(index, keys.content_ids[index], keys.tokens[index], worker,
                                            Action.COMPUTE, task_id=f"{keys.request_id}/s{index}"))
        segments.sort(key=lambda s: s.index)
        return self._build(keys, home, prefix, tuple(segments), combine_tokens, placed.estimate, lead)


    @staticmethod
    def _with_repeats(plan: PrefillPlan, keys: RequestKeys, depth: int) -> PrefillPlan:
        """Later copies of a segment reuse the first copy's KV from wherever the plan puts it.

        Only copies past the prefix hit are planned: one inside it is already covered by the prefix."""
        placed = {s.key: s for s in plan.segments}
        extra = [i for i in keys.pic_indices if i >= depth and placed[keys.content_ids[i]].index != i]
        if not extra:
            return plan
        repeats = tuple(SegmentPlan(i, keys.content_ids[i], keys.tokens[i], placed[keys.content_ids[i]].worker,
                                    Action.REUSE, tier=placed[keys.content_ids[i]].tier) for i in extra)
        return replace(plan, segments=tuple(sorted(plan.segments + repeats, key=lambda s: s.index)))


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


def default_cache(policy: str) -> str:
    """The workers' cache rule a policy runs with unless told otherwise: the baselines keep their plain
    policy (SGLang's LRU radix cache, §9.1), Nebula its self-tuning share (§6)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
    return POLICIES[policy].default_cache


def make_policy(name: str, config: ClusterConfig, costs: TransferCosts, scheduler: str = "greedy") -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name](config, costs, scheduler)

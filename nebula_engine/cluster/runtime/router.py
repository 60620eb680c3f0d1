"""The router: runs on the elected leader, plans each request with the control plane and dispatches the plan.

A plan becomes messages: ``Scatter`` to each worker that prefills a cold segment, ``ScatterLead`` to the worker
that prefills the prompt's lead when it is not the home, and one ``Combine`` to the combine home listing, per PIC
segment, the peer to fetch it from (and the peer to read the prompt's first pages from). A prompt's regular tokens
are keyed in blocks (``request_keys.block_segments``), as the workers report them. The router never touches KV
bytes. It keeps
each request in flight until its combine is done. When a prefill peer stops answering (silent for the timeout of
the peer's ``Liveness``, the one tracker every part of a peer reads), the view forgets what it held and the planner
stays off it; every in-flight request whose combine home it was is reported lost to its front end (a resumable ``Failed``), which submits it again: only
front ends start attempts, so two runs of one request never share an attempt number. A request that only reads a
segment from the dead peer, or had a segment (or its lead) scattered to it, is not re-planned: its home's pin times
out and the home computes it itself. A dead decode peer is the home's to handle (its hand-off fails).
A router that does not lead refuses submissions (``NotLeader``); one it cannot plan fails them. A new leader
starts with no requests in flight (front ends resubmit theirs) and rebuilds its view from every worker's
snapshot. With ``observe_transfers`` (off by default), the fixed costs of reads and scatters the planner charges
follow what the homes report each read took (``TaskDone.transfers``, ``ObservedTransferCosts``); a new leader
starts again from the configured ones. The prefill speed that converts those seconds into prefill tokens is the
fastest timing of the leader's engine (``faster_prefill_timed``: at start-up, then while the cluster is idle).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.liveness import Liveness
from nebula_engine.cluster.control.config import ClusterConfig
from nebula_engine.cluster.control.control_plane import ControlPlane
from nebula_engine.cluster.control.messages import Action, DoneEvent
from nebula_engine.cluster.control.observed_costs import ObservedTransferCosts
from nebula_engine.cluster.control.planner import TransferCosts
from nebula_engine.cluster.control.request_keys import block_segments, prompt_keys

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    submit: wire.Submit
    attempt: int
    home: int
    combine_task: str  # its TaskDone ends the request's time in flight
    tasks: set[str] = field(default_factory=set)


class RouterService:
    def __init__(self, name: str, prefill_peers: list[str], decode_peers: list[str], config: ClusterConfig,
                 policy: str, send: Callable[[str, wire.Msg], None], pic_key: Callable[[str | None, list[int]], str],
                 liveness: Liveness, observe_transfers: bool = False):
        """``observe_transfers``: plan with the read latency and scatter dispatch the homes report
        (``ObservedTransferCosts``) instead of ``config``'s fixed values."""
        self.name = name
        self.prefill_peers = prefill_peers
        self.decode_peers = decode_peers
        self.config = config
        self.policy = policy
        self.send = send
        self.pic_key = pic_key
        self.liveness = liveness
        self.clock = liveness.clock
        self.observe_transfers = observe_transfers
        self.active = False
        self.control: ControlPlane | None = None
        self.observed: ObservedTransferCosts | None = None
        self.in_flight: dict[str, InFlight] = {}
        self.dead: set[str] = set()
        self.num_planned = 0
        self.num_lost = 0

    # ---- leadership ----
    def activate(self) -> None:
        """This peer just became the leader: fresh view, ask every prefill worker for its cache index."""
        self.control = ControlPlane(self.config, self.policy)
        self.observed = ObservedTransferCosts(self.config.profile) if self.observe_transfers else None
        self.in_flight.clear()
        self.dead = set()
        self.active = True
        for peer in self.prefill_peers:
            self.deliver(peer, wire.SnapshotRequest(sender=self.name))

    def deactivate(self) -> None:
        self.active = False
        self.control = None
        self.in_flight.clear()

    def faster_prefill_timed(self, per_token_s: float) -> bool:
        """A new timing of this engine's prefill, taken while the cluster was idle. The planner converts a
        transfer's seconds into prefill tokens with the fastest timing seen: peers that share the cores only slow
        a timing down, and they are modelled apart (``shared_compute``). True when it was faster and is used."""
        prefill = self.config.profile.prefill
        if not 0.0 < per_token_s < prefill.per_token_s:
            return False
        self.config = self.config.with_profile(prefill=replace(prefill, per_token_s=per_token_s))
        logger.info("%s: planning with a prefill of %.4f ms a token (was %.4f)", self.name, per_token_s * 1e3,
                    prefill.per_token_s * 1e3)
        if self.observed is not None:
            self.observed.profile = self.config.profile
        if self.active:
            self._plan_with_current_costs()
        return True

    def _plan_with_current_costs(self) -> None:
        """The control plane plans from now on with the profile's costs, or the observed ones when observing."""
        profile = self.observed.current_profile() if self.observed is not None else self.config.profile
        self.control.set_costs(TransferCosts.from_profile(profile, len(self.prefill_peers)))

    def deliver(self, peer: str, message: wire.Msg) -> None:
        self.send(peer, message)

    # ---- requests ----
    def on_submit(self, msg: wire.Submit) -> None:
        if not self.active:
            self.deliver(msg.sender, wire.NotLeader(sender=self.name, request_id=msg.request_id, attempt=msg.attempt))
            return
        try:
            self._plan(msg, msg.attempt)
        except Exception as error:  # a planning bug must fail this request, not leave it waiting forever
            logger.exception("planning %s failed", msg.request_id)
            self.in_flight.pop(msg.request_id, None)
            self.deliver(msg.sender, wire.Failed(sender=self.name, request_id=msg.request_id, attempt=msg.attempt,
                                                 message=f"the router could not plan it: {error!r}",
                                                 client_error=False))

    def _plan(self, msg: wire.Submit, attempt: int) -> None:
        spec = None if self.policy == "pc" else msg.pic_backend
        segments = block_segments([(s.kind, msg.token_ids[s.start:s.start + s.length]) for s in msg.segments])
        keys = prompt_keys(f"{msg.request_id}#{attempt}", segments, lambda ids: self.pic_key(spec, ids))
        pinned = msg.route in self.prefill_peers and msg.route not in self.dead
        decision = self.control.on_request(keys, self.clock(), self.prefill_peers.index(msg.route) if pinned else None)
        plan = decision.plan
        if decision.pc_share is not None:
            for peer in self.prefill_peers:
                self.deliver(peer, wire.PCShare(sender=self.name, pc_share=decision.pc_share))
        home_name = self.prefill_peers[plan.combine_home]
        sources, local_tasks, compute_here, flight = [], [], [], InFlight(msg, attempt, plan.combine_home, plan.combine_task_id)
        computed = {s.key for s in plan.segments if s.action is Action.COMPUTE}
        for segment in plan.segments:
            pic_index = keys.pic_indices.index(segment.index)
            holder = self.prefill_peers[segment.worker]
            if segment.action is Action.COMPUTE and segment.worker != plan.combine_home:
                self.deliver(holder, wire.Scatter(sender=self.name, task_id=segment.task_id,
                                                  request_id=msg.request_id, segment_index=pic_index,
                                                  key=segment.key, token_ids=list(segments[segment.index][1]),
                                                  pic_backend=spec))
                flight.tasks.add(segment.task_id)
            elif segment.action is Action.COMPUTE:
                local_tasks.append(segment.task_id)
                compute_here.append(pic_index)
            if segment.action in (Action.COMPUTE, Action.REUSE) and segment.worker != plan.combine_home:
                sources.append(wire.SourceSpec(pic_index, segment.key, holder, segment.key in computed))
        live_decode_peers = self._live_decode_peers()
        decode = live_decode_peers[0] if live_decode_peers else ""
        prefix_peer, prefix_tokens = "", 0
        if plan.prefix is not None and plan.prefix.worker != plan.combine_home:
            prefix_peer, prefix_tokens = self.prefill_peers[plan.prefix.worker], plan.prefix.num_tokens
        if plan.lead is not None:  # a helper holding the prefix prefills the lead after it: the home reads both
            prefix_peer, prefix_tokens = self.prefill_peers[plan.lead.worker], keys.prefix_tokens(keys.pic_indices[0])
            self.deliver(prefix_peer, wire.ScatterLead(sender=self.name, task_id=plan.lead.task_id,
                                                       request_id=msg.request_id,
                                                       token_ids=list(msg.token_ids[:prefix_tokens])))
            flight.tasks.add(plan.lead.task_id)
        flight.tasks.update([plan.combine_task_id, *local_tasks])
        self.in_flight[msg.request_id] = flight
        self.num_planned += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("planned %s attempt %d: combine on %s, %d scattered, %d read, lead on %s, decode on %s; "
                         "estimate %.0f prefill tokens, queues now %s", msg.request_id, attempt, home_name,
                         len(flight.tasks) - 1 - len(local_tasks) - (plan.lead is not None), len(sources),
                         prefix_peer if plan.lead is not None else "home", decode or "-", plan.estimate,
                         " ".join(f"{queue:.0f}" for queue in self.control.view.outstanding()))
        self.deliver(home_name, wire.Combine(
            sender=self.name, task_id=plan.combine_task_id, request_id=msg.request_id, attempt=attempt,
            frontend=msg.sender, token_ids=msg.token_ids, segments=msg.segments, params=msg.params,
            pic_backend=spec, sources=sources, local_task_ids=local_tasks, decode_peer=decode,
            prefix_peer=prefix_peer, prefix_tokens=prefix_tokens, compute_here=compute_here,
            prefix_fresh=plan.lead is not None))

    def _live_decode_peers(self) -> list[str]:
        return [p for p in self.decode_peers if p not in self.dead]

    # ---- worker reports ----
    def on_task_done(self, msg: wire.TaskDone) -> None:
        if not self.active:
            return
        self.control.on_event(DoneEvent(msg.worker_index, msg.seq, msg.task_id), self.clock())
        flight = self.in_flight.get(msg.request_id)
        if flight is not None and msg.task_id == flight.combine_task:
            del self.in_flight[msg.request_id]
        if logger.isEnabledFor(logging.DEBUG):
            for transfer in msg.transfers:  # what the spec's two fixed costs are measured from
                logger.debug("transfer from %s: %d tokens, %s, pin to store %.4f s, predicted prefill %.4f s",
                             transfer.peer, transfer.num_tokens, "scattered" if transfer.scattered else "cached",
                             transfer.seconds, self.config.profile.prefill.compute_seconds(transfer.num_tokens, 0.0))
        if msg.transfers and self.observed is not None:
            self._observe(msg.transfers)

    def _observe(self, transfers: list[wire.TransferTime]) -> None:
        for transfer in transfers:
            if transfer.scattered:
                self.observed.observe_scatter(transfer.seconds, transfer.num_tokens)
            else:
                self.observed.observe_read(transfer.seconds)
        self._plan_with_current_costs()
        logger.debug("transfer costs now: read latency %.3f s, scatter dispatch %.3f s",
                     self.observed.read_latency_s, self.observed.dispatch_s)

    def on_cache_events(self, msg: wire.CacheEventMsg) -> None:
        if not self.active:
            return
        now = self.clock()
        if msg.snapshot:  # also restarts the worker's numbering: a restarted worker counts from 1 again
            self.control.view.forget_worker(msg.worker_index)
        for event in msg.events:
            self.control.on_event(event, now)

    @property
    def dead_after_s(self) -> float:
        return self.liveness.dead_after_s

    def seen(self, peer: str) -> None:
        """A message from ``peer`` came in (the peer told its ``Liveness`` first)."""
        if peer in self.dead and self.liveness.alive(peer):  # it came back (restarted): plan on it again
            self.dead.discard(peer)
            if peer in self.prefill_peers:
                self.control.view.set_down(self.prefill_peers.index(peer), False)

    # ---- failures ----
    def check_liveness(self) -> list[str]:
        """Declare peers silent for ``dead_after_s`` dead and report what was planned on them lost; returns them."""
        if not self.active:
            return []
        now = self.clock()
        newly_dead = [p for p in self.prefill_peers + self.decode_peers
                      if p != self.name and p not in self.dead and not self.liveness.alive(p)]
        for peer in newly_dead:
            logger.warning("peer %s silent for %.1f s: planning around it", peer, now - self.liveness.last_heard(peer))
            self.dead.add(peer)
            if peer in self.prefill_peers:
                worker = self.prefill_peers.index(peer)
                self.control.view.forget_worker(worker)
                self.control.view.set_down(worker, True)
                for request_id, flight in list(self.in_flight.items()):
                    if flight.home == worker:
                        self._lose(request_id, flight, peer)
        return newly_dead

    def _lose(self, request_id: str, flight: InFlight, peer: str) -> None:
        for task in flight.tasks:
            self.control.view.release(task)
        del self.in_flight[request_id]
        self.num_lost += 1
        self.deliver(flight.submit.sender, wire.Failed(
            sender=self.name, request_id=request_id, attempt=flight.attempt, client_error=False, resumable=True,
            message=f"its prefill peer {peer} stopped answering"))


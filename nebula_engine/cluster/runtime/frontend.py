"""The cluster's ``EngineClient``: what every peer's HTTP API talks to.

A request is admitted here (``RequestPort.admit`` with the local engine: its limits, its PIC backend resolved to a
spec every peer reads the same), submitted to the current leader's router, and its outputs arrive from whichever
peer serves it. Each submission has an attempt number; only outputs of the current attempt are passed on, and only
the front end starts a new one. A request for ``n > 1`` completions is fanned out here, as a single engine's parallel
sampling does it: each completion is a request of its own through the cluster (attempts, hand-off, failover), and
their outputs are gathered back into one. Top logprobs arrive per token, each once; prompt logprobs with a stream's
first output.

Every request ends, with its output or an error:
- Without a quorum (this peer is cut off from most of the cluster) a new request fails at once (503). With a
  quorum but no leader yet (an election is on) it waits for one.
- A request runs again (a new attempt) when the leader changes before it produced anything, when a peer
  carrying it falls silent (the sender of its latest output, and the decode peer that sender is handing it
  to, until that one sends an output itself), or when a peer reports it lost (a resumable
  ``Failed``: its prefill peer died, a hand-off failed). A request that already streamed tokens continues
  rather than restarts: the new attempt's prompt is the original plus the tokens streamed so far, its
  ``max_tokens`` is reduced by as many, and its outputs are appended to them, so a client never sees a
  piece twice or misses one (a stop string that spans the seam is found here).
- A request that waits for a leader longer than ``failover_timeout_s`` (from the last sign of life of the peer
  it lost), or that is lost more times than the cluster has peers, fails with ``EngineDeadError`` (503).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

import msgspec

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.liveness import DEFAULT_FAILOVER_TIMEOUT_S, Liveness
from nebula_engine.cluster.runtime.worker_codec import candidates_from_wire, params_to_wire
from nebula_engine.engine.output_processor import find_stop_string
from nebula_engine.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from nebula_engine.engine.parallel_sampling import ParentRequest, child_request_id
from nebula_engine.engine.port_types import EngineDeadError, EngineError, EngineStats
from nebula_engine.engine.request_port import ENGINE_DEFAULT, AdmittedRequest, RequestPort
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.tokenizer import Tokenizer
from nebula_engine.pic.segments import SegmentKind

logger = logging.getLogger(__name__)

_MAX_CHAR_TOKENS = 4  # a UTF-8 character spans at most 4 bytes, so at most 4 byte-level tokens


@dataclass(frozen=True)
class Streamed:
    """Output of a request so far: its tokens, their logprobs, the text a client has been given for them, and
    (when asked) each token's top logprobs."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    text: str = ""
    top_logprobs: tuple[dict[int, Logprob], ...] = ()

    def __add__(self, other: Streamed) -> Streamed:
        return Streamed(self.token_ids + other.token_ids, self.logprobs + other.logprobs, self.text + other.text,
                        self.top_logprobs + other.top_logprobs)

    def upto(self, num_tokens: int) -> Streamed:
        """Its first ``num_tokens`` tokens (the text is kept: it never runs ahead of the tokens kept)."""
        return Streamed(self.token_ids[:num_tokens], self.logprobs[:num_tokens], self.text,
                        self.top_logprobs[:num_tokens])


def placed(have: tuple[dict[int, Logprob], ...], start: int, new: list[dict[int, Logprob]]
           ) -> tuple[dict[int, Logprob], ...]:
    """``have`` with positions ``start``, ``start + 1``, ... set to ``new``. A hand-off's first token may in
    principle arrive after its decode peer's first output: the gap is filled when it does."""
    padded = have + ({},) * (start - len(have))
    return padded[:start] + tuple(new) + padded[start + len(new):]


@dataclass
class _Pending:
    submit: wire.Submit  # as the client asked (attempt 0)
    params: SamplingParams
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # shared by the completions of an n > 1 request
    attempt: int = 0
    server: str | None = None  # the peer that sent the latest output of the current attempt
    handoff_to: str = ""  # the decode peer ``server`` is handing it to: its death loses the request too
    earlier: Streamed = Streamed()  # what earlier attempts streamed (the current attempt continues it)
    current: Streamed = Streamed()  # what the current attempt streamed
    cached: list[int] | None = None  # prefix, PIC, recomputed, hit counts of the first attempt that reported them
    prompt_logprobs: PromptLogprobs | None = None  # those of the first attempt that reported them (when asked)
    waiting_since: float | None = None  # when it started needing a leader to (re)submit to; None: submitted
    losses: int = 0
    done: bool = False

    @property
    def started(self) -> bool:
        return self.server is not None


class ClusterFrontend:
    def __init__(self, name: str, requests: RequestPort, send: Callable[[str, wire.Msg], None],
                 leader: Callable[[], str | None], has_quorum: Callable[[], bool],
                 prefill_peers: list[str], liveness: Liveness,
                 failover_timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S, max_losses: int = 8):
        self.name = name
        self.prefill_peers = prefill_peers
        self.requests = requests
        self.send = send
        self.leader = leader
        self.has_quorum = has_quorum
        self.liveness = liveness
        self.failover_timeout_s = failover_timeout_s
        self.max_losses = max_losses
        self._pending: dict[str, _Pending] = {}  # by the id each completion is submitted as
        self._completion_ids: dict[str, list[str]] = {}  # a client's request id -> those of its completions
        self.num_resubmitted = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self.requests.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.requests.max_model_len

    def stats(self) -> EngineStats:
        local = self.requests.stats()
        serving = self.leader() is not None or self.has_quorum()
        return replace(local, alive=local.alive and serving)

    async def generate(self, request_id: str, prompt, params: SamplingParams,
                       pic_backend: str | None = ENGINE_DEFAULT,
                       route: str | None = None) -> AsyncIterator[RequestOutput]:
        completions = self._validated_completions(request_id, prompt, params, pic_backend, route)
        if self.leader() is None and not self.has_quorum():
            raise EngineDeadError(f"peer {self.name} cannot reach a majority of the cluster (no leader): "
                                  "send the request to another peer")
        self._completion_ids[request_id] = [pending.submit.request_id for pending in completions]
        for pending in completions:
            self._pending[pending.submit.request_id] = pending
            self._submit(pending)
        gathered = ParentRequest(request_id, params.n) if params.n > 1 else None
        try:
            while True:
                item = await completions[0].queue.get()
                if isinstance(item, BaseException):
                    raise item
                if gathered is not None:
                    gathered.update(item.request_id, item)
                    item = gathered.output()
                yield item
                if item.finished:
                    return
        finally:
            self._forget(request_id)

    def _validated_completions(self, request_id: str, prompt, params: SamplingParams, pic_backend: str | None,
                               route: str | None) -> list[_Pending]:
        """The request's completions, each submitted and carried through the cluster on its own. With ``n > 1``,
        as a single engine's parallel sampling: completion ``i`` is request ``child_request_id(i, request_id)``
        with ``params.for_completion(i)``; their outputs share one queue."""
        if route is not None and route not in self.prefill_peers:
            raise ValueError(f"prefill_peer {route!r} is not a prefill peer of this cluster: {self.prefill_peers}")
        request = self.requests.admit(prompt, params, pic_backend)
        ids = [request_id] if params.n == 1 else [child_request_id(i, request_id) for i in range(params.n)]
        taken = [i for i in dict.fromkeys([request_id, *ids]) if i in self._pending or i in self._completion_ids]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        return [_Pending(self._submit_message(completion_id, replace(request, params=request.params.for_completion(i)),
                                              route), params.for_completion(i), queue)
                for i, completion_id in enumerate(ids)]

    def _submit_message(self, request_id: str, request: AdmittedRequest, route: str | None) -> wire.Submit:
        """An admitted request as the router receives it: its backend by spec, which parses back to an equal one."""
        segmented, token_ids = request.segmented, list(request.token_ids)
        segments = ([wire.Segment(s.kind.value, s.start, s.length) for s in segmented.segments] if segmented
                    else [wire.Segment(SegmentKind.REGULAR.value, 0, len(token_ids))])
        spec = request.backend.spec if request.backend is not None else None
        return wire.Submit(sender=self.name, request_id=request_id, attempt=0, token_ids=token_ids,
                           segments=segments, params=params_to_wire(request.params), pic_backend=spec,
                           route=route or "")

    def abort(self, request_id: str) -> None:
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        for completion_id in self._completion_ids.pop(request_id, ()):
            pending = self._pending.pop(completion_id, None)
            if pending is not None and not pending.done and pending.server is not None:
                self.send(pending.server, wire.Abort(sender=self.name, request_id=completion_id))

    # ---- (re)submission ----
    def _submit(self, pending: _Pending) -> None:
        leader = self.leader()
        if leader is None:
            pending.waiting_since = pending.waiting_since or self.liveness.clock()
            return  # submitted once a leader is known (check), or failed after failover_timeout_s
        pending.waiting_since = None
        self.send(leader, self._attempt_submit(pending))

    def _attempt_submit(self, pending: _Pending) -> wire.Submit:
        """The current attempt: the original request, continued after what earlier attempts streamed."""
        original, streamed = pending.submit, pending.earlier.token_ids
        if not streamed:
            return msgspec.structs.replace(original, attempt=pending.attempt)
        params = replace(pending.params, max_tokens=pending.params.max_tokens - len(streamed))
        if pending.prompt_logprobs is not None:  # reported already, by the first output
            params = replace(params, prompt_logprobs=None)
        seam = wire.Segment(SegmentKind.REGULAR.value, len(original.token_ids), len(streamed))
        return msgspec.structs.replace(original, attempt=pending.attempt, token_ids=original.token_ids + list(streamed),
                                       segments=original.segments + [seam], params=params_to_wire(params))

    def _run_again(self, pending: _Pending, reason: str, since: float | None = None) -> None:
        """A new attempt that continues what the client has been given."""
        pending.losses += 1
        if pending.losses > self.max_losses:
            self._fail(pending, EngineDeadError(f"request lost {pending.losses} times (last: {reason}); giving up"))
            return
        kept = self._complete_characters(pending.current)
        pending.earlier += kept
        pending.current, pending.server, pending.handoff_to = Streamed(), None, ""
        pending.attempt += 1
        self.num_resubmitted += 1
        logger.info("%s: running %s again as attempt %d after %d streamed tokens: %s", self.name,
                    pending.submit.request_id, pending.attempt, len(pending.earlier.token_ids), reason)
        if len(pending.earlier.token_ids) >= pending.params.max_tokens:
            self._finish_at_length(pending)
            return
        pending.waiting_since = since
        self._submit(pending)

    def _complete_characters(self, streamed: Streamed) -> Streamed:
        """``streamed`` without trailing tokens of a character not complete yet: they are not in its text (the
        detokenizer holds them back), so the next attempt regenerates them instead of losing their bytes."""
        ids = list(streamed.token_ids)
        for _ in range(_MAX_CHAR_TOKENS):
            if not ids or not self.tokenizer.decode(ids[-_MAX_CHAR_TOKENS - 2:]).endswith("\ufffd"):
                break
            ids.pop()
        return streamed.upto(len(ids))

    def _finish_at_length(self, pending: _Pending) -> None:
        pending.done = True
        pending.queue.put_nowait(self._merged(pending, finished=True, finish_reason="length", stop_reason=None))

    def _fail(self, pending: _Pending, error: BaseException) -> None:
        pending.done = True
        pending.queue.put_nowait(error)

    # ---- from peers ----
    def on_output(self, msg: wire.Output | wire.Failed) -> None:
        pending = self._pending.get(msg.request_id)
        if pending is None or pending.done or msg.attempt != pending.attempt:
            return
        if isinstance(msg, wire.Failed):
            if msg.resumable:
                self._run_again(pending, f"{msg.sender}: {msg.message}")
            else:
                self._fail(pending, (ValueError if msg.client_error else EngineError)(msg.message))
            return
        pending.server, pending.handoff_to = msg.sender, msg.handoff_to
        top = pending.current.top_logprobs
        if pending.params.logprobs is not None:
            top = placed(top, msg.top_logprobs_start, [candidates_from_wire(c) for c in msg.top_logprobs])
        pending.current = Streamed(tuple(msg.token_ids), tuple(msg.logprobs), msg.text, top)
        if pending.cached is None:
            pending.cached = list(msg.cached)
        if pending.prompt_logprobs is None and msg.prompt_logprobs is not None:
            pending.prompt_logprobs = [None if c is None else candidates_from_wire(c)
                                       for c in msg.prompt_logprobs[:len(pending.submit.token_ids)]]
        output = self._merged(pending, msg.finished, msg.finish_reason, msg.stop_reason)
        pending.done = output.finished
        pending.queue.put_nowait(output)
        if output.finished and not msg.finished:  # stopped on a stop string across the seam
            self.send(msg.sender, wire.Abort(sender=self.name, request_id=msg.request_id))

    def _merged(self, pending: _Pending, finished: bool, finish_reason: str | None,
                stop_reason: str | int | None) -> RequestOutput:
        streamed = pending.earlier + pending.current
        text = streamed.text
        if pending.earlier.text and pending.params.stop and not finished:
            stop = find_stop_string(text, len(pending.current.text), pending.params.stop)
            if stop is not None and stop[1] < len(pending.earlier.text):
                text, finished, finish_reason, stop_reason = text[:stop[1]], True, "stop", stop[0]
        asked = pending.params.logprobs is not None
        top = list(streamed.top_logprobs[:len(streamed.token_ids)]) if asked else None
        completion = CompletionOutput(0, text, list(streamed.token_ids), sum(streamed.logprobs) if asked else None,
                                      top, finish_reason, stop_reason, list(streamed.logprobs))
        prefix, pic, recomputed, *hits = pending.cached or (0, 0, 0)
        prompt_logprobs = list(pending.prompt_logprobs) if pending.prompt_logprobs is not None else None
        return RequestOutput(pending.submit.request_id, None, list(pending.submit.token_ids), [completion],
                             finished=finished, prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=hits[0] if hits else prefix + pic,
                             num_prefix_cached_tokens=prefix,
                             num_pic_cached_tokens=pic, num_recomputed_tokens=recomputed)

    def on_not_leader(self, msg: wire.NotLeader) -> None:
        pending = self._pending.get(msg.request_id)
        if pending is not None and not pending.done and msg.attempt == pending.attempt and not pending.started:
            pending.waiting_since = pending.waiting_since or self.liveness.clock()  # check() submits it again

    def on_leader_change(self, leader: str | None, previous: str | None = None) -> None:
        """Requests that have produced nothing yet, or whose output came from the old leader (it may have died
        before handing them to a decode peer), go to the new leader: it knows nothing of them."""
        for pending in list(self._pending.values()):
            if pending.done:
                continue
            if not pending.started:
                pending.attempt += 1  # whatever the old leader planned is not waited for any more
                self._submit(pending)
            elif previous is not None and pending.server == previous:
                self._run_again(pending, f"the leader {previous} changed", self.liveness.last_heard(previous))

    def check(self) -> None:
        """Called periodically: run again what a dead peer was streaming, submit what waits for a leader, and
        fail what waited too long."""
        now = self.liveness.clock()
        for pending in list(self._pending.values()):
            if pending.done:
                continue
            carriers = [peer for peer in (pending.server, pending.handoff_to) if peer]
            dead = next((peer for peer in carriers if not self.liveness.alive(peer)), None)
            if dead is not None:
                self._run_again(pending, f"peer {dead} stopped answering", self.liveness.last_heard(dead))
            elif pending.waiting_since is not None:
                if now - pending.waiting_since > self.failover_timeout_s:
                    self._fail(pending, EngineDeadError(
                        f"no leader could take the request for {self.failover_timeout_s:.0f} s "
                        f"(peer {self.name} may be cut off from the cluster)"))
                elif self.leader() is not None:
                    pending.attempt += 1
                    self._submit(pending)


"""The cluster's ``EngineClient``: what every peer's HTTP API talks to.

A request is validated here (with the local engine's tokenizer and limits), submitted to the current leader's
router, and its outputs arrive from whichever peer serves it. Each submission has an attempt number; only
outputs of the current attempt are passed on. If the leader changes before a request produced anything, it is
submitted again to the new leader (a higher attempt), so no client request fails because a leader died.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from nebula_engine.cluster import wire
from nebula_engine.cluster.worker import params_to_wire
from nebula_engine.engine.async_engine import AsyncLLMEngine, EngineError, EngineStats
from nebula_engine.engine.llm_engine import DEFAULT_BACKEND
from nebula_engine.engine.outputs import CompletionOutput, RequestOutput
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.tokenizer import Tokenizer
from nebula_engine.pic.segments import SegmentedPrompt, SegmentKind

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    submit: wire.Submit
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    attempt: int = 0
    started: bool = False  # an output of the current attempt arrived
    server: str | None = None  # the peer that sent the latest output


class ClusterFrontend:
    def __init__(self, name: str, engine: AsyncLLMEngine, send: Callable[[str, wire.Msg], None],
                 leader: Callable[[], str | None], deliver_local: Callable[[wire.Msg], None],
                 prefill_peers: list[str]):
        self.name = name
        self.prefill_peers = prefill_peers
        self.engine = engine
        self.send = send
        self.leader = leader
        self.deliver_local = deliver_local
        self._pending: dict[str, _Pending] = {}
        self.num_resubmitted = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        local = self.engine.stats()
        return EngineStats(local.num_waiting, local.num_running, alive=local.alive and self.leader() is not None)

    async def generate(self, request_id: str, prompt, params: SamplingParams,
                       pic_backend: str | None | object = DEFAULT_BACKEND,
                       route: str | None = None) -> AsyncIterator[RequestOutput]:
        engine = self.engine.engine
        if route is not None and route not in self.prefill_peers:
            raise ValueError(f"prefill_peer {route!r} is not a prefill peer of this cluster: {self.prefill_peers}")
        segmented = prompt if isinstance(prompt, SegmentedPrompt) else None
        token_ids = list(segmented.token_ids) if segmented is not None else list(prompt)
        engine.validate_request(token_ids, params)
        if pic_backend is not DEFAULT_BACKEND and pic_backend is not None:
            engine.resolve_request_backend(pic_backend)  # a bad spec is the client's error, raised here
        if request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already in use")
        segments = ([wire.Segment(s.kind.value, s.start, s.length) for s in segmented.segments] if segmented
                    else [wire.Segment(SegmentKind.REGULAR.value, 0, len(token_ids))])
        spec = "" if pic_backend is DEFAULT_BACKEND else pic_backend
        if spec == "" and engine.pic_backend is None:
            spec = None
        submit = wire.Submit(sender=self.name, request_id=request_id, attempt=0, token_ids=token_ids,
                             segments=segments, params=params_to_wire(params), pic_backend=spec, route=route or "")
        pending = _Pending(submit)
        self._pending[request_id] = pending
        self._submit(pending)
        done = False
        try:
            while not done:
                item = await pending.queue.get()
                if isinstance(item, wire.Failed):
                    done = True
                    raise (ValueError if item.client_error else EngineError)(item.message)
                done = item.finished
                yield _to_output(item, token_ids)
        finally:
            self._pending.pop(request_id, None)
            if not done and pending.server is not None:
                self._send_to(pending.server, wire.Abort(sender=self.name, request_id=request_id))

    def abort(self, request_id: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None and pending.server is not None:
            self._send_to(pending.server, wire.Abort(sender=self.name, request_id=request_id))

    def _submit(self, pending: _Pending) -> None:
        leader = self.leader()
        if leader is None:
            return  # submitted when a leader is known (on_leader_change)
        message = wire.Submit(**{**{f: getattr(pending.submit, f) for f in pending.submit.__struct_fields__},
                                 "attempt": pending.attempt})
        self._send_to(leader, message)

    def _send_to(self, peer: str, message: wire.Msg) -> None:
        if peer == self.name:
            self.deliver_local(message)
        else:
            self.send(peer, message)

    # ---- from peers ----
    def on_output(self, msg: wire.Output | wire.Failed) -> None:
        pending = self._pending.get(msg.request_id)
        if pending is None or msg.attempt != pending.attempt:
            return
        pending.started = True
        pending.server = msg.sender
        pending.queue.put_nowait(msg)

    def on_replanned(self, msg: wire.Replanned) -> None:
        pending = self._pending.get(msg.request_id)
        if pending is not None and msg.attempt > pending.attempt:
            pending.attempt, pending.started = msg.attempt, False

    def on_leader_change(self, leader: str | None, previous: str | None = None) -> None:
        """Requests that have produced nothing yet, or whose prefill ran on the old leader (it may have died
        before handing them to a decode peer), go to the new leader: it knows nothing of them."""
        if leader is None:
            return
        for pending in self._pending.values():
            if not pending.started or (previous is not None and pending.server == previous):
                pending.attempt += 1
                self.num_resubmitted += 1
                self._submit(pending)


def _to_output(msg: wire.Output, prompt_token_ids: list[int]) -> RequestOutput:
    completion = CompletionOutput(0, msg.text, list(msg.token_ids), list(msg.logprobs), msg.finish_reason,
                                  msg.stop_reason)
    prefix, pic, recomputed = msg.cached
    return RequestOutput(msg.request_id, None, prompt_token_ids, [completion], finished=msg.finished,
                         num_cached_tokens=prefix + pic, num_prefix_cached_tokens=prefix, num_pic_cached_tokens=pic,
                         num_recomputed_tokens=recomputed)

"""The data plane of one peer: executes the router's commands on this peer's engine and moves KV with NIXL.

- ``Scatter``: prefill one cold PIC segment alone into this worker's PIC store.
- ``ScatterLead``: prefill a prompt's lead (its regular tokens before the first PIC segment) exactly into this
  worker's prefix cache, for the combine home to read as the rest of its prefix.
- ``Combine``: fetch the request's remote segments (pin on the holder, NIXL read into fresh local pages,
  store locally, unpin), then run the request on the local engine (its PIC executor finds every segment in the
  local store and runs the combine prefill). With a live decode peer, the request stops after its first token
  and its pages are held until the decode peer has read them (``Handoff``); otherwise it decodes here. If the
  decode peer dies (or never confirms) first, the request is reported lost (a resumable ``Failed``) and its
  front end runs it again after the token already streamed.
- ``Handoff`` (decode peers): reserve pages, read the prompt K/V from the prefill peer, continue decoding (a
  hybrid model's linear-attention state after the prompt comes in the message itself); a read that fails reports
  the request lost the same way (recomputing here would repeat the first token).
- Cache events (PIC stores/evicts, plus one PC event per cached block of the prompt, ``block_segments``) and task
  completions go to the
  router. A failed or timed-out transfer never produces a wrong result: the segment is simply computed here.

The engine is reached only through its ``EngineClusterPort``, whose cache operations run on the engine's own
thread; this worker's own state (pins held for readers, pending replies, PC keys) lives on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import io
import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

import msgspec
import torch

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.liveness import Liveness
from nebula_engine.cluster.control.request_keys import block_segments, prompt_keys, token_content_id
from nebula_engine.cluster.runtime.transfer import KVTransferAgent, TransferError
from nebula_engine.engine.cluster_port import EngineClusterPort, PrefixPin, SegmentPin
from nebula_engine.engine.kv_gate import KVGate
from nebula_engine.engine.outputs import RequestOutput
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.structured_outputs import StructuredOutputsParams
from nebula_engine.kvcache.events import CacheEvent, CacheKind, EvictEvent, MoveEvent, StoreEvent, Tier
from nebula_engine.kvcache.pool import OutOfPagesError
from nebula_engine.pic.layout import CombineLayout
from nebula_engine.pic.segments import PromptSegment, SegmentedPrompt, SegmentKind

logger = logging.getLogger(__name__)

PIN_TIMEOUT_S = 10.0
TRANSFER_TIMEOUT_S = 10.0
HANDOFF_TIMEOUT_S = TRANSFER_TIMEOUT_S + 5  # a live decode peer reads within its transfer timeout
MAX_ABANDONED_PINS = 4096  # remembered unanswered pins; older ones are forgotten (their holder is long gone)


def params_to_wire(params: SamplingParams) -> wire.Params:
    fields = {name: (list(value) if isinstance(value, tuple) else value) for name, value in vars(params).items()}
    return wire.Params(fields=fields)


def params_from_wire(params: wire.Params) -> SamplingParams:
    fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.fields.items()}
    if isinstance(fields.get("structured_outputs"), dict):
        fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
    return SamplingParams(**fields)


def segmented_from_wire(token_ids: list[int], segments: list[wire.Segment]) -> SegmentedPrompt:
    return SegmentedPrompt(tuple(token_ids), tuple(PromptSegment(SegmentKind(s.kind), s.start, s.length)
                                                   for s in segments))


def engine_request_id(request_id: str, attempt: int) -> str:
    """Attempts of one request may overlap on one engine (a re-plan while the first is still running)."""
    return f"{request_id}#{attempt}"


def output_to_wire(sender: str, request_id: str, output: RequestOutput, attempt: int,
                   handoff_to: str = "", fresh: tuple[int, int] = (0, 0)) -> wire.Output:
    """``fresh``: the prompt tokens the engine found cached only because they were prefilled for this request (PIC
    segments here or on another peer, the lead into the prefix cache), and how many of them the prefix cache held
    (``MadeForRequest.tokens``); they are no cache hits."""
    completion = output.outputs[0]
    prefix_hits = output.num_prefix_cached_tokens - fresh[1]
    hits = max(prefix_hits, output.num_cached_tokens - fresh[0])
    return wire.Output(sender=sender, request_id=request_id, attempt=attempt, text=completion.text,
                       token_ids=list(completion.token_ids), logprobs=list(completion.token_logprobs),
                       finished=output.finished, finish_reason=completion.finish_reason,
                       stop_reason=completion.stop_reason,
                       cached=[prefix_hits, output.num_pic_cached_tokens,
                               output.num_recomputed_tokens, hits], handoff_to=handoff_to)


async def _opening(awaitable, gate: KVGate | None, part: str):
    """``awaitable``'s result; ``gate``'s ``part`` opens when it ends, however it ends."""
    try:
        return await awaitable
    finally:
        if gate is not None:
            gate.open(part)


def lead_key(token_ids: list[int]) -> str:
    """What a worker tracks a lead it prefills for another peer by (``_computing``), apart from PIC keys."""
    return "lead/" + token_content_id(token_ids)


@dataclass(frozen=True)
class MadeForRequest:
    """What a combine's home computed for the request itself before the combine ran: no cache hits."""

    segments: frozenset[int] = frozenset()  # PIC indices of segments prefilled for it (here or scattered)
    lead_cached_before: int | None = None  # tokens of the lead the prefix cache held before the home prefilled it

    def tokens(self, segmented: SegmentedPrompt, prefix_len: int) -> tuple[int, int]:
        """Of the prompt's tokens a combine after a ``prefix_len`` prefix found cached, those made for it, and how
        many of them came from the prefix cache."""
        lead = 0 if self.lead_cached_before is None else max(0, prefix_len - self.lead_cached_before)
        return lead + reused_tokens(segmented, prefix_len, self.segments), lead


def reused_tokens(segmented: SegmentedPrompt, prefix_len: int, indices: set[int]) -> int:
    """Tokens of the PIC segments ``indices`` that a combine after a ``prefix_len`` prefix reuses."""
    if not indices:
        return 0
    segments = segmented.pic_segments
    return CombineLayout.plan(len(segmented.token_ids), prefix_len, [(s.start, s.length) for s in segments],
                              [i in indices for i in range(len(segments))]).num_reused


def _state_bytes(state: dict) -> bytes:
    """The wire codec of state beyond pages (``PinReply.state``, ``Handoff.state``): tensors by torch's format,
    read back with ``weights_only`` (no arbitrary unpickling); an empty state is empty bytes."""
    if not state:
        return b""
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    return buffer.getvalue()


async def _encode_state(state: dict) -> bytes:
    """``_state_bytes`` off the event loop when there is anything to encode (a hybrid's state is megabytes)."""
    return await asyncio.to_thread(_state_bytes, state) if state else b""


async def _decode_state(data: bytes) -> dict:
    """``_state_from_bytes`` off the event loop when there is anything to decode."""
    return await asyncio.to_thread(_state_from_bytes, data) if data else {}


def _state_from_bytes(data: bytes) -> dict:
    """Inverse of ``_state_bytes``; ValueError for bytes that are not a saved dict (nothing else is loaded)."""
    if not data:
        return {}
    try:
        state = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:  # torch raises several types for malformed archives
        raise ValueError(f"malformed state bytes: {error}") from error
    if not isinstance(state, dict):
        raise ValueError(f"state bytes hold a {type(state).__name__}, not a dict")
    return state


class WorkerService:
    def __init__(self, name: str, role: str, worker_index: int, engine: EngineClusterPort, agent: KVTransferAgent,
                 send: Callable[[str, wire.Msg], None], leader: Callable[[], str | None],
                 pic_key: Callable[[str | None, list[int]], str], liveness: Liveness):
        self.name, self.role, self.worker_index = name, role, worker_index
        self.liveness = liveness
        self.engine = engine
        self.agent = agent
        self.send = send
        self.leader = leader
        self.pic_key = pic_key  # (wire spec, segment ids) -> store key, the same function the router plans with
        self._tags = itertools.count()
        self._pin_replies: dict[str, asyncio.Future] = {}
        # pins given up on (no reply in time, holder counted dead): their unpin, sent if the reply still comes
        self._abandoned_pins: collections.OrderedDict[str, wire.Msg] = collections.OrderedDict()
        self._appeared: dict[str, asyncio.Event] = {}  # PIC key -> set when a task computing it here is done
        self._computing: dict[str, int] = {}  # PIC key -> tasks (scatter or combine) computing it here
        self._pinned: dict[str, list[SegmentPin]] = {}  # key -> pins held for remote readers
        self._pinned_prefixes: dict[tuple[str, str], PrefixPin] = {}  # (reader, tag) -> pin held for it
        self._handoffs: dict[str, asyncio.Future] = {}  # request id -> done when the decode peer has read
        self._reads_expected()  # none yet: the agent progresses slowly until a pin or a hand-off
        self._streams: dict[str, asyncio.Task] = {}  # request id -> task serving it here
        self._pc_page_keys: dict[str, set[str]] = {}  # radix page hash -> segment chain keys ending in it
        self._next_seq = 1  # sequence number of the next event reported to the router (cache events and task done)
        self.transfer_bytes = 0
        self.transfer_failures = 0
        self.lead_tokens_prefilled = 0  # prompt leads prefilled into the prefix cache: for a waiting combine here or
        # elsewhere (a ``ScatterLead``)
        self.leads_for_others = 0  # ``ScatterLead``s prefilled here for another peer's combine
        self.evictions = {"pc": 0, "pic": 0}  # entries that left the device (dropped or demoted), from the events

    # ---- router commands ----
    def _start_computing(self, keys: list[str]) -> None:
        for key in keys:
            self._computing[key] = self._computing.get(key, 0) + 1
            if key not in self._appeared or self._appeared[key].is_set():
                self._appeared[key] = asyncio.Event()

    def _stop_computing(self, keys: list[str]) -> None:
        for key in keys:
            count = self._computing.get(key, 0) - 1
            if count > 0:
                self._computing[key] = count
                continue
            self._computing.pop(key, None)
            event = self._appeared.get(key)
            if event is not None:
                event.set()

    def _local_keys(self, msg: wire.Combine, segmented: SegmentedPrompt) -> dict[int, str]:
        """PIC keys this combine computes here if they are cold (everything not fetched from a peer), by PIC
        segment index."""
        remote = {s.segment_index for s in msg.sources if s.peer and s.peer != self.name}
        keys = {index: self.pic_key(msg.pic_backend, segmented.segment_ids(segment))
                for index, segment in enumerate(segmented.pic_segments) if index not in remote}
        return {index: key for index, key in keys.items() if key}

    async def on_scatter(self, msg: wire.Scatter) -> None:
        self._start_computing([msg.key])
        try:
            await self.engine.prefill_segment(msg.pic_backend, msg.token_ids)
        except Exception:
            logger.exception("scatter prefill %s failed", msg.task_id)
        finally:
            self._stop_computing([msg.key])
            self._report(wire.TaskDone(sender=self.name, worker_index=self.worker_index, task_id=msg.task_id,
                                       seq=self._take_seqs(1), request_id=msg.request_id))

    async def on_scatter_lead(self, msg: wire.ScatterLead) -> None:
        """Prefill a prompt's lead exactly into the prefix cache (after the prefix cached here) for a combine home
        to read; a ``PinPrefix`` of it that arrives meanwhile waits for it (``on_pin_prefix``)."""
        ids = msg.token_ids[:len(msg.token_ids) // self.engine.page_size * self.engine.page_size]
        key = lead_key(ids)
        self._start_computing([key])
        start = time.monotonic()
        try:
            if ids:
                cached = await self.engine.prefill_prefix(msg.task_id, ids)
                self.lead_tokens_prefilled += len(ids) - cached
                self.leads_for_others += 1
                logger.debug("lead %s: %d tokens prefilled after %d cached, in %.3f s", msg.task_id, len(ids) - cached,
                             cached, time.monotonic() - start)
        except Exception:
            logger.exception("prefilling the lead %s failed", msg.task_id)
        finally:
            self._stop_computing([key])
            self._report(wire.TaskDone(sender=self.name, worker_index=self.worker_index, task_id=msg.task_id,
                                       seq=self._take_seqs(1), request_id=msg.request_id))

    async def on_combine(self, msg: wire.Combine) -> None:
        start = time.monotonic()
        task = asyncio.current_task()
        self._streams[msg.request_id] = task
        logger.debug("combine %s attempt %d: %d remote sources, prefix from %s", msg.request_id, msg.attempt,
                     len(msg.sources), msg.prefix_peer or "-")
        computing: list[str] = []
        transfers: list[wire.TransferTime] = []
        kv = fresh = None
        try:
            segmented = segmented_from_wire(msg.token_ids, msg.segments)
            local_keys = self._local_keys(msg, segmented)
            computing = list(local_keys.values())
            self._start_computing(computing)
            params = params_from_wire(msg.params)
            backend = msg.pic_backend
            remote = [s for s in msg.sources if s.peer and s.peer != self.name]
            prefix_read = asyncio.ensure_future(self._fetch_prefix(msg)) \
                if msg.prefix_peer and msg.prefix_peer != self.name else None
            # the combine waits in the engine's queue behind a KV gate that opens when its remote KV is here (else
            # it would queue only then). While a scattered segment is prefilled elsewhere, the cold segments planned
            # here are prefilled meanwhile; a read of cached KV is too short to overlap a forward with, and that
            # prefill would be a forward of its own: then the combine computes them in its step
            waits = bool(remote) or prefix_read is not None
            local_prefill = (any(s.fresh for s in remote) or msg.prefix_fresh) and bool(msg.compute_here)
            # the regular tokens before the first PIC segment (a system prompt) do not depend on the segments awaited:
            # prefilled exactly meanwhile (after the prefix, when it is read), they reach the combine as a prefix hit.
            # Unlike a cold segment, the combine would compute them in full: a forward of their own costs little more
            lead = self._lead(segmented) if waits else None
            gate = KVGate(["reads"] + ["prefill"] * local_prefill + ["lead"] * bool(lead)) if waits else None
            reads = asyncio.gather(asyncio.gather(*(self._fetch(s, segmented, msg.pic_backend, transfers)
                                                    for s in remote)), prefix_read or asyncio.sleep(0))
            kv = asyncio.ensure_future(asyncio.gather(
                _opening(reads, gate, "reads"),
                self._prefill_here(msg, segmented, gate, computing, local_keys) if local_prefill
                else asyncio.sleep(0, result=[]),
                self._prefill_lead(msg, lead, gate, prefix_read) if lead else asyncio.sleep(0)))

            async def made_for_request() -> MadeForRequest:
                (copied, prefix_before), computed_here, lead_cached_before = await kv
                if msg.prefix_fresh and prefix_before is not None:  # the lead read was prefilled for it
                    lead_cached_before = prefix_before
                copied_keys = {s.key for s, ok in zip(remote, copied) if ok}
                if waits:
                    logger.debug("combine %s: read %d/%d remote segments, prefilled %d here%s; KV ready after %.3f s",
                                 msg.request_id, len(copied_keys), len(remote), len(computed_here),
                                 f" and a {len(lead)}-token lead" if lead_cached_before is not None else "",
                                 time.monotonic() - start)
                return MadeForRequest(frozenset(
                    {s.segment_index for s in remote if s.fresh and s.key in copied_keys} | set(computed_here)),
                    lead_cached_before)

            fresh = asyncio.ensure_future(made_for_request())
            if msg.decode_peer and msg.decode_peer != self.name and self.liveness.alive(msg.decode_peer):
                await self._prefill_and_hand_off(msg, segmented, params, backend, fresh, gate)
            else:
                await self._serve_locally(msg, segmented, params, backend, fresh, gate)
            self._report_prompt_cached(segmented, msg.pic_backend)
        except ValueError as error:  # (the request's own fault: bad backend for this model, ...)
            self._fail(msg, str(error), client_error=True)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            logger.exception("combine of %s failed", msg.request_id)
            self._fail(msg, f"prefill failed: {error!r}", client_error=False)
        finally:
            for pending in (kv, fresh):  # the combine ended first (failed, cancelled): stop its reads
                if pending is not None and not pending.done():
                    pending.cancel()
            logger.debug("combine %s attempt %d ended after %.3f s", msg.request_id, msg.attempt,
                         time.monotonic() - start)
            self._stop_computing(computing)
            self._streams.pop(msg.request_id, None)
            for task_id in [msg.task_id, *msg.local_task_ids]:
                self._report(wire.TaskDone(sender=self.name, worker_index=self.worker_index, task_id=task_id,
                                           seq=self._take_seqs(1), request_id=msg.request_id,
                                           transfers=transfers if task_id == msg.task_id else []))

    async def _prefill_here(self, msg: wire.Combine, segmented: SegmentedPrompt, gate: KVGate,
                            computing: list[str], local_keys: dict[int, str]) -> list[int]:
        """Prefill the combine's cold segments planned on this worker into its PIC store, then open ``gate``'s
        "prefill" part (on the engine thread, so the combine can run in the next step); the PIC indices of those it
        computed (their tokens are no cache hits when the combine finds them). On failure the combine computes
        them itself. Once they are stored, a peer's pin that waits for them (``computing``, which the combine
        would release only when it ends) is answered; ``local_keys``: their PIC keys (``_local_keys``)."""
        segments = [list(segmented.segment_ids(segmented.pic_segments[index])) for index in msg.compute_here]
        try:
            made = await self.engine.prefill_missing_segments(msg.pic_backend, segments, then_open=(gate, "prefill"))
        except Exception:
            logger.exception("prefilling the local segments of %s failed; the combine computes them", msg.request_id)
            return []
        finally:
            gate.open("prefill")  # (already open unless the call never ran)
        stored = [local_keys[index] for index in msg.compute_here if local_keys.get(index) in computing]
        for key in stored:
            computing.remove(key)
        self._stop_computing(stored)
        return [index for index, made_here in zip(msg.compute_here, made) if made_here]

    def _lead(self, segmented: SegmentedPrompt) -> list[int]:
        """The full pages of the prompt's tokens before its first PIC segment (none when the combine would not
        start after a cached prefix)."""
        pic = segmented.pic_segments
        if not pic or not self.engine.combines_start_after_prefix:
            return []
        return list(segmented.token_ids[:pic[0].start // self.engine.page_size * self.engine.page_size])

    async def _prefill_lead(self, msg: wire.Combine, lead: list[int], gate: KVGate,
                            prefix_read: asyncio.Future | None) -> int | None:
        """Once the prefix read (if any) has ended, prefill what the prefix cache lacks of ``lead`` into it, then
        open ``gate``'s "lead" part. Returns the lead's tokens the prefix cache held before; None when it held them
        all. On failure the combine computes the lead itself."""
        cached = None
        try:
            if prefix_read is not None:
                await asyncio.wait([prefix_read])  # (its failure is the combine's reads' to report)
            cached = await self.engine.cached_prefix_pages(lead) * self.engine.page_size
            if cached >= len(lead):
                return None
            cached = await self.engine.prefill_prefix(f"{engine_request_id(msg.request_id, msg.attempt)}/lead", lead)
            self.lead_tokens_prefilled += len(lead) - cached
            return cached
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("prefilling the lead of %s failed; the combine computes it", msg.request_id)
            return cached
        finally:
            gate.open("lead")

    def _fail(self, msg: wire.Combine | wire.Handoff, message: str, client_error: bool,
              resumable: bool = False) -> None:
        self.send(msg.frontend, wire.Failed(sender=self.name, request_id=msg.request_id, attempt=msg.attempt,
                                            message=message, client_error=client_error, resumable=resumable))

    async def _serve_locally(self, msg: wire.Combine, segmented, params, backend, fresh: asyncio.Future,
                             gate: KVGate | None) -> None:
        engine_id = engine_request_id(msg.request_id, msg.attempt)
        made = None  # the prompt's counts are those of the first output: worked out once, not per token
        async for output in self.engine.generate(engine_id, segmented, params, backend, kv_gate=gate):
            if made is None:
                made = (await fresh).tokens(segmented, output.num_prefix_cached_tokens)
                logger.debug("combine %s: first token; %d prompt tokens, %d from the prefix cache, %d PIC reused, "
                             "%d of them recomputed", msg.request_id, len(output.prompt_token_ids),
                             output.num_prefix_cached_tokens, output.num_pic_cached_tokens,
                             output.num_recomputed_tokens)
            self.send(msg.frontend, output_to_wire(self.name, msg.request_id, output, msg.attempt,
                                                   fresh=made))

    async def _prefill_and_hand_off(self, msg: wire.Combine, segmented, params, backend, fresh: asyncio.Future,
                                    gate: KVGate | None) -> None:
        engine_id = engine_request_id(msg.request_id, msg.attempt)
        first = await self.engine.generate_held(engine_id, segmented, replace(params, max_tokens=1), backend,
                                                kv_gate=gate)
        made = (await fresh).tokens(segmented, first.num_prefix_cached_tokens)
        completion = first.outputs[0]
        done_here = completion.finish_reason == "stop" or params.max_tokens == 1
        if done_here:  # finished on its first token: nothing to hand off
            await self.engine.release_held(engine_id)
            self.send(msg.frontend, output_to_wire(self.name, msg.request_id, first, msg.attempt,
                                                   fresh=made))
            return
        first.finished = False
        first.outputs[0].finish_reason = None
        first_wire = output_to_wire(self.name, msg.request_id, first, msg.attempt, handoff_to=msg.decode_peer,
                                    fresh=made)
        self.send(msg.frontend, first_wire)  # TTFT
        pages = await self.engine.held_pages(engine_id)
        state = await self.engine.held_state(engine_id)
        handoff_done = asyncio.get_running_loop().create_future()
        self._handoffs[engine_id] = handoff_done
        self._reads_expected()
        self.send(msg.decode_peer, wire.Handoff(
            sender=self.name, request_id=msg.request_id, attempt=msg.attempt, frontend=msg.frontend,
            prompt_token_ids=list(first.prompt_token_ids), first_token=completion.token_ids[0],
            first_logprob=completion.token_logprobs[0], params=msg.params, pages=pages,
            cached=list(first_wire.cached), state=await _encode_state(state)))
        try:
            outcome = await self._unless_dead(handoff_done, msg.decode_peer, HANDOFF_TIMEOUT_S)
        finally:
            self._handoffs.pop(engine_id, None)
            self._reads_expected()
            await self.engine.release_held(engine_id)
        if outcome != "done":
            logger.warning("decode peer %s did not take the hand-off of %s (%s)", msg.decode_peer, msg.request_id,
                           outcome)
            self._fail(msg, f"decode peer {msg.decode_peer} did not take the hand-off ({outcome})",
                       client_error=False, resumable=True)

    async def _unless_dead(self, reply: asyncio.Future, peer: str, timeout: float) -> str:
        """Wait for ``reply`` from ``peer``: "done", or "dead" once ``peer`` counts as dead, or "timed out"."""
        peer_died = asyncio.ensure_future(self.liveness.wait_dead(peer))
        try:
            await asyncio.wait((reply, peer_died), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            peer_died.cancel()
        if reply.done():
            return "done"
        return "dead" if peer_died.done() else "timed out"

    def on_handoff_done(self, msg: wire.HandoffDone) -> None:
        future = self._handoffs.get(msg.request_id)
        if future is not None and not future.done():
            future.set_result(True)

    # ---- remote segments ----
    async def _fetch(self, source: wire.SourceSpec, segmented: SegmentedPrompt, spec: str | None,
                     transfers: list[wire.TransferTime]) -> bool:
        """Copy segment ``source`` from its holder into the local PIC store; True when it was copied, and its time
        goes to ``transfers``. On any failure it stays uncached here and the combine computes it. Local pages are
        allocated while the pin travels, so the copy waits for this engine's thread once more (the insert), not
        twice."""
        segment = segmented.pic_segments[source.segment_index]
        ids = list(segmented.segment_ids(segment))
        tag = f"{self.name}/{next(self._tags)}"
        start = time.monotonic()
        reply_future = asyncio.get_running_loop().create_future()
        self._pin_replies[tag] = reply_future
        self.send(source.peer, wire.PinSegment(sender=self.name, tag=tag, key=source.key, num_tokens=len(ids),
                                               wait_s=PIN_TIMEOUT_S / 2))
        allocation = asyncio.ensure_future(self.engine.allocate_pages(  # unless it arrived here meanwhile
            -(-len(ids) // self.engine.page_size), unless_cached=source.key))
        try:
            outcome = await self._unless_dead(reply_future, source.peer, PIN_TIMEOUT_S)
        except asyncio.CancelledError:
            asyncio.ensure_future(self._release_when_allocated(allocation))
            raise
        finally:
            self._pin_replies.pop(tag, None)
        pages = await allocation
        if outcome != "done":
            self.transfer_failures += 1
            self._abandon_pin(tag, wire.Unpin(sender=self.name, key=source.key))
            logger.warning("no pin reply from %s for %s (%s): computing it here", source.peer, source.key, outcome)
            await self._release(pages)
            return False
        reply = reply_future.result()
        if not reply.ok:
            await self._release(pages)
            return False
        pinned = time.monotonic()
        try:
            copied = await self._copy_in(source, ids, reply, pages)
            if copied:
                transfers.append(wire.TransferTime(source.peer, time.monotonic() - start, len(ids), source.fresh))
            return copied
        finally:
            self.send(source.peer, wire.Unpin(sender=self.name, key=source.key))
            logger.debug("segment of %d tokens from %s: pinned after %.4f s, in the store after %.4f s%s", len(ids),
                         source.peer, pinned - start, time.monotonic() - start, " (prefilled for it)" * source.fresh)

    async def _release_when_allocated(self, allocation: asyncio.Future) -> None:
        await self._release(await allocation)

    async def _release(self, pages: list[int] | None) -> None:
        if pages:
            await self.engine.release_pages(pages)

    async def _read_into(self, holder: str, remote_pages: list[int], pages: list[int], what: str) -> bool:
        """Read ``holder``'s ``remote_pages`` into local ``pages``; on failure the pages are released (and ``what`` is
        recomputed)."""
        try:
            self.transfer_bytes += await asyncio.to_thread(self.agent.read_pages, holder, remote_pages, pages,
                                                           TRANSFER_TIMEOUT_S)
        except (TransferError, ValueError) as error:
            self.transfer_failures += 1
            logger.warning("reading %s from %s failed (%s): it will be recomputed", what, holder, error)
            await self._release(pages)
            return False
        return True

    async def _copy_in(self, source: wire.SourceSpec, ids: list[int], reply: wire.PinReply,
                       pages: list[int] | None) -> bool:
        if pages is None:
            return False
        if len(reply.pages) != len(pages):  # the holder's entry is laid out otherwise (another page size)
            await self._release(pages)
            return False
        try:
            state = await _decode_state(reply.state)
        except ValueError as error:
            self.transfer_failures += 1
            logger.warning("the state of %s from %s is unreadable (%s): it will be recomputed", source.key,
                           source.peer, error)
            await self._release(pages)
            return False
        if not await self._read_into(source.peer, reply.pages, pages, source.key):
            return False
        await self.engine.import_segment(source.key, len(ids), pages, state)
        return True

    async def _fetch_prefix(self, msg: wire.Combine) -> int | None:
        """Copy the prompt's first ``msg.prefix_tokens`` tokens' pages from ``msg.prefix_peer``'s prefix cache into
        this peer's (as its own prefill would have cached them); the engine then finds them as a prefix hit. Only
        the pages past those already cached here are read; on any failure the rest is simply computed. Returns the
        tokens cached here before the read when it added any, else None."""
        page_size = self.engine.page_size
        # the last prompt token is always computed: a prefix covering the whole prompt is cut a page short
        num_pages = min(msg.prefix_tokens, len(msg.token_ids) - 1) // page_size
        wanted = list(msg.token_ids[:num_pages * page_size])
        have = await self.engine.cached_prefix_pages(wanted)
        if have >= num_pages:
            return None
        tag = f"{self.name}/{next(self._tags)}"
        reply_future = asyncio.get_running_loop().create_future()
        self._pin_replies[tag] = reply_future
        self.send(msg.prefix_peer, wire.PinPrefix(sender=self.name, tag=tag, token_ids=wanted))
        try:
            outcome = await self._unless_dead(reply_future, msg.prefix_peer, PIN_TIMEOUT_S)
        finally:
            self._pin_replies.pop(tag, None)
        if outcome != "done":
            self.transfer_failures += 1
            self._abandon_pin(tag, wire.UnpinPrefix(sender=self.name, tag=tag))
            logger.warning("no prefix pin reply from %s (%s): computing it here", msg.prefix_peer, outcome)
            return None
        reply = reply_future.result()
        try:
            if reply.ok and await self._copy_prefix_in(msg.prefix_peer, wanted, reply.pages, have):
                return have * page_size
            return None
        finally:
            if reply.ok:
                self.send(msg.prefix_peer, wire.UnpinPrefix(sender=self.name, tag=tag))

    async def _copy_prefix_in(self, holder: str, token_ids: list[int], remote_pages: list[int], have: int) -> bool:
        """Read the holder's pages past the ``have`` leading pages cached here and cache them after those."""
        if len(remote_pages) <= have:
            return False
        pages = await self.engine.allocate_pages(len(remote_pages) - have)
        if pages is None or not await self._read_into(holder, remote_pages[have:], pages, "a prefix"):
            return False
        return await self.engine.import_prefix(token_ids[:len(remote_pages) * self.engine.page_size], pages, have)

    async def on_pin_prefix(self, msg: wire.PinPrefix) -> None:
        key = lead_key(msg.token_ids)
        if key in self._computing:  # a ``ScatterLead`` here is prefilling it: pin it once it is cached
            try:
                await asyncio.wait_for(self._appeared[key].wait(), PIN_TIMEOUT_S / 2)
            except asyncio.TimeoutError:
                pass
        pin = await self.engine.pin_prefix(msg.token_ids)
        if pin is not None:
            self._pinned_prefixes[(msg.sender, msg.tag)] = pin
            self._reads_expected()
        self.send(msg.sender, wire.PinReply(sender=self.name, tag=msg.tag, ok=pin is not None,
                                            pages=list(pin.pages) if pin else []))

    async def on_unpin_prefix(self, msg: wire.UnpinPrefix) -> None:
        pin = self._pinned_prefixes.pop((msg.sender, msg.tag), None)
        if pin is not None:
            self._reads_expected()
            await self.engine.unpin_prefix(pin)

    async def on_pin(self, msg: wire.PinSegment) -> None:
        start = time.monotonic()
        pin = await self.engine.pin_segment(msg.key, msg.num_tokens)
        if pin is None and msg.wait_s > 0 and msg.key in self._computing:  # a task here is computing it
            try:
                await asyncio.wait_for(self._appeared[msg.key].wait(), msg.wait_s)
                pin = await self.engine.pin_segment(msg.key, msg.num_tokens)
            except asyncio.TimeoutError:
                pass
        if pin is None:
            self.send(msg.sender, wire.PinReply(sender=self.name, tag=msg.tag, ok=False, pages=[], state=b""))
            return
        try:
            state = await _encode_state(pin.state)
        except Exception:
            logger.exception("the state of %s could not be encoded: refusing the pin", msg.key)
            await self.engine.unpin_segment(pin)
            self.send(msg.sender, wire.PinReply(sender=self.name, tag=msg.tag, ok=False, pages=[], state=b""))
            return
        self._pinned.setdefault(msg.key, []).append(pin)
        self._reads_expected()
        self.send(msg.sender, wire.PinReply(sender=self.name, tag=msg.tag, ok=True, pages=list(pin.pages),
                                            state=state))
        logger.debug("pinned %s for %s in %.4f s", msg.key, msg.sender, time.monotonic() - start)

    def _reads_expected(self) -> None:
        """Tell the transfer agent whether a peer may be reading our pages: a pin held for it or a hand-off."""
        if self.agent is not None:
            self.agent.serve_reads(bool(self._pinned or self._pinned_prefixes or self._handoffs))

    def _abandon_pin(self, tag: str, unpin: wire.Msg) -> None:
        self._abandoned_pins[tag] = unpin
        while len(self._abandoned_pins) > MAX_ABANDONED_PINS:  # replies from holders that died never come
            self._abandoned_pins.popitem(last=False)

    def on_pin_reply(self, msg: wire.PinReply) -> None:
        future = self._pin_replies.get(msg.tag)
        if future is not None and not future.done():
            future.set_result(msg)
            return
        unpin = self._abandoned_pins.pop(msg.tag, None)
        if unpin is not None and msg.ok:  # a reply after we gave up: the holder pinned for nothing; release it
            self.send(msg.sender, unpin)

    async def on_unpin(self, msg: wire.Unpin) -> None:
        pins = self._pinned.get(msg.key)
        if not pins:
            return
        pin = pins.pop()
        if not pins:
            del self._pinned[msg.key]
            self._reads_expected()
        await self.engine.unpin_segment(pin)

    # ---- decode side ----
    async def on_handoff(self, msg: wire.Handoff) -> None:
        task = asyncio.current_task()
        self._streams[msg.request_id] = task
        params = params_from_wire(msg.params)
        prompt = list(msg.prompt_token_ids)
        engine_id = engine_request_id(msg.request_id, msg.attempt)
        try:
            try:
                state = await _decode_state(msg.state)
                pages = await self.engine.reserve_prefilled(engine_id, len(prompt))
                moved = await asyncio.to_thread(self.agent.read_pages, msg.sender, msg.pages[:len(pages)], pages,
                                                TRANSFER_TIMEOUT_S)
                self.transfer_bytes += moved
                stream = self.engine.generate_prefilled(engine_id, prompt, msg.first_token, msg.first_logprob,
                                                        params, tuple(msg.cached), state)
            except (TransferError, ValueError, OutOfPagesError) as error:
                self.transfer_failures += 1
                logger.warning("hand-off of %s failed (%s): its front end runs it again", msg.request_id, error)
                await self.engine.cancel_prefilled(engine_id)
                self._fail(msg, f"decode peer {self.name} could not read its KV: {error}", client_error=False,
                           resumable=True)
                return
            finally:
                self.send(msg.sender, wire.HandoffDone(sender=self.name, request_id=engine_id))
            async for output in stream:
                self.send(msg.frontend, output_to_wire(self.name, msg.request_id, output, msg.attempt))
        except asyncio.CancelledError:
            raise
        except Exception as error:
            logger.exception("decode of %s failed", msg.request_id)
            self._fail(msg, f"decode failed: {error!r}", client_error=False)
        finally:
            self._streams.pop(msg.request_id, None)

    def on_abort(self, msg: wire.Abort) -> None:
        task = self._streams.get(msg.request_id)
        if task is not None:
            task.cancel()

    # ---- events to the router ----
    def _report(self, message: wire.Msg) -> None:
        leader = self.leader()
        if leader is None:
            return
        if leader == self.name:
            self.local_router(message)
        else:
            self.send(leader, message)

    local_router: Callable[[wire.Msg], None] = staticmethod(lambda message: None)

    def _take_seqs(self, count: int) -> int:
        """The first of ``count`` fresh sequence numbers. Taken right before the report is sent (no await in
        between), so numbers increase in send order on the ordered channel to the router."""
        first, self._next_seq = self._next_seq, self._next_seq + count
        return first

    def _report_events(self, events: list[CacheEvent], snapshot: bool = False) -> None:
        """Send ``events`` renumbered in this worker's sequence (the engine's own numbers count cache events only)."""
        first = self._take_seqs(len(events))
        numbered = [msgspec.structs.replace(event, worker=self.worker_index, seq=first + i)
                    for i, event in enumerate(events)]
        self._report(wire.CacheEventMsg(sender=self.name, worker_index=self.worker_index, events=numbered,
                                        snapshot=snapshot))

    def _report_prompt_cached(self, segmented: SegmentedPrompt, spec: str | None) -> None:
        """Ask the engine thread to report the prompt's cached blocks as PC entries (``block_segments``)."""
        asyncio.get_running_loop().create_task(self._pc_events(segmented, spec))

    async def _pc_events(self, segmented: SegmentedPrompt, spec: str | None) -> None:
        if not self.engine.caches_prefixes:
            return
        blocks = block_segments([(s.kind.value, segmented.segment_ids(s)) for s in segmented.segments])
        keys = prompt_keys("", blocks, lambda ids: self.pic_key(spec, ids))
        ends = itertools.accumulate(len(ids) for _, ids in blocks)
        page_counts = [-(-end // self.engine.page_size) for end in ends]
        # one hash per block whose last page is cached, up to the first that is not (or no longer) cached
        hashes = await self.engine.cached_prefix_hashes(list(segmented.token_ids), page_counts)
        events = []
        for num_tokens, key, block_hash in zip(keys.tokens, keys.pc_keys, hashes):
            self._pc_page_keys.setdefault(block_hash, set()).add(key)
            events.append(StoreEvent(self.worker_index, 0, CacheKind.PC, (key,), num_tokens))
        if events:
            self._report_events(events)

    async def pump_events(self, snapshot: bool = False) -> None:
        """Send the engine's cache events since the last call (or, with ``snapshot``, its whole PIC index)."""
        if self.role != "prefill":
            return

        drained = await self.engine.drain_cache_events(snapshot)
        if snapshot:  # every PIC entry with the tier it is on (PC is reported per segment, by _pc_events)
            events = [StoreEvent(self.worker_index, 0, CacheKind.PIC, (key,), tokens, tier)
                      for key, tokens, tier in drained.pic_entries]
        else:
            events = [event for raw in drained.events for event in self._for_router(raw)]
        if events or snapshot:
            self._report_events(events, snapshot)

    def _for_router(self, event: CacheEvent) -> list[CacheEvent]:
        """What the router hears of one engine event: a PIC event as it is; of a PC page event only the loss of
        the prompt segments whose last page it takes off the device (PC stores are reported by ``_pc_events``)."""
        left_device = ((isinstance(event, EvictEvent) and event.tier is Tier.DEVICE)
                       or (isinstance(event, MoveEvent) and event.src is Tier.DEVICE))
        if left_device:
            self.evictions[event.kind.value] += len(event.keys)
        if event.kind is CacheKind.PIC:
            return [event]
        if isinstance(event, EvictEvent) or (isinstance(event, MoveEvent) and event.dst is not Tier.DEVICE):
            return [EvictEvent(self.worker_index, 0, CacheKind.PC, (key,), 0)
                    for page in event.keys for key in self._pc_page_keys.pop(page, ())]
        return []

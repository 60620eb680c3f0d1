"""The prefill work the router plans on one worker.

- ``Scatter``: prefill one cold PIC segment alone into this worker's PIC store.
- ``ScatterLead``: prefill a prompt's lead (its regular tokens before the first PIC segment) exactly into this
  worker's prefix cache, for the combine home to read as the rest of its prefix.
- ``Combine``: fetch the request's remote segments and prefix (``RemoteReads``) while the cold segments planned
  here and the prompt's lead are prefilled, then run the request on the local engine (its PIC executor finds every
  segment in the local store and runs the combine prefill). With a live decode peer the request is handed off after
  its first token (``Handoffs``); otherwise it decodes here.

Every task's end is reported to the router, and a combine's cached prompt as PC entries (``CacheReporter``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.cache_reporting import CacheReporter
from nebula_engine.cluster.runtime.handoff import Handoffs
from nebula_engine.cluster.runtime.in_flight import InFlightKeys, Streams, lead_key
from nebula_engine.cluster.runtime.liveness import Liveness
from nebula_engine.cluster.runtime.remote_reads import RemoteReads
from nebula_engine.cluster.runtime.worker_codec import (OutputStream, engine_request_id, failure, params_from_wire,
                                                        segmented_from_wire)
from nebula_engine.engine.kv_port import KVPort
from nebula_engine.engine.kv_gate import KVGate
from nebula_engine.engine.kv_plan import KVPlan
from nebula_engine.engine.request_port import RequestPort
from nebula_engine.pic.layout import CombineLayout
from nebula_engine.pic.segments import SegmentedPrompt

logger = logging.getLogger(__name__)


async def _opening(awaitable, gate: KVGate | None, part: str):
    """``awaitable``'s result; ``gate``'s ``part`` opens when it ends, however it ends."""
    try:
        return await awaitable
    finally:
        if gate is not None:
            gate.open(part)


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


class PrefillTasks:
    def __init__(self, name: str, kv: KVPort, requests: RequestPort, send: Callable[[str, wire.Msg], None],
                 liveness: Liveness, pic_key: Callable[[str | None, list[int]], str], in_flight: InFlightKeys,
                 streams: Streams, reads: RemoteReads, handoffs: Handoffs, reporter: CacheReporter):
        self.name = name
        self.kv = kv
        self.requests = requests
        self.send = send
        self.liveness = liveness
        self.pic_key = pic_key  # (wire spec, segment ids) -> store key, the same function the router plans with
        self.in_flight = in_flight
        self.streams = streams
        self.reads = reads
        self.handoffs = handoffs
        self.reporter = reporter
        self.lead_tokens_prefilled = 0  # prompt leads prefilled into the prefix cache: for a waiting combine here or
        # elsewhere (a ``ScatterLead``)
        self.leads_for_others = 0  # ``ScatterLead``s prefilled here for another peer's combine

    def _local_keys(self, msg: wire.Combine, segmented: SegmentedPrompt) -> dict[int, str]:
        """PIC keys this combine computes here if they are cold (everything not fetched from a peer), by PIC
        segment index."""
        remote = {s.segment_index for s in msg.sources if s.peer and s.peer != self.name}
        keys = {index: self.pic_key(msg.pic_backend, segmented.segment_ids(segment))
                for index, segment in enumerate(segmented.pic_segments) if index not in remote}
        return {index: key for index, key in keys.items() if key}

    async def on_scatter(self, msg: wire.Scatter) -> None:
        self.in_flight.start([msg.key])
        try:
            await self.kv.prefill_segment(msg.pic_backend, msg.token_ids)
        except Exception:
            logger.exception("scatter prefill %s failed", msg.task_id)
        finally:
            self.in_flight.stop([msg.key])
            self.reporter.task_done(msg.task_id, msg.request_id)

    async def on_scatter_lead(self, msg: wire.ScatterLead) -> None:
        """Prefill a prompt's lead exactly into the prefix cache (after the prefix cached here) for a combine home
        to read; a ``PinPrefix`` of it that arrives meanwhile waits for it (``PinServer.on_pin_prefix``)."""
        ids = msg.token_ids[:len(msg.token_ids) // self.kv.page_size * self.kv.page_size]
        key = lead_key(ids)
        self.in_flight.start([key])
        start = time.monotonic()
        try:
            if ids:
                cached = await self.requests.prefill_prefix(msg.task_id, ids)
                self.lead_tokens_prefilled += len(ids) - cached
                self.leads_for_others += 1
                logger.debug("lead %s: %d tokens prefilled after %d cached, in %.3f s", msg.task_id, len(ids) - cached,
                             cached, time.monotonic() - start)
        except Exception:
            logger.exception("prefilling the lead %s failed", msg.task_id)
        finally:
            self.in_flight.stop([key])
            self.reporter.task_done(msg.task_id, msg.request_id)

    async def on_combine(self, msg: wire.Combine) -> None:
        start = time.monotonic()
        self.streams.serving(msg.request_id)
        logger.debug("combine %s attempt %d: %d remote sources, prefix from %s", msg.request_id, msg.attempt,
                     len(msg.sources), msg.prefix_peer or "-")
        computing: list[str] = []
        transfers: list[wire.TransferTime] = []
        kv = fresh = None
        try:
            segmented = segmented_from_wire(msg.token_ids, msg.segments)
            local_keys = self._local_keys(msg, segmented)
            computing = list(local_keys.values())
            self.in_flight.start(computing)
            params = params_from_wire(msg.params)
            backend = msg.pic_backend
            remote = [s for s in msg.sources if s.peer and s.peer != self.name]
            prefix_read = asyncio.ensure_future(self.reads.fetch_prefix(msg)) \
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
            reads = asyncio.gather(asyncio.gather(*(self.reads.fetch_segment(s, segmented, msg.pic_backend, transfers)
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
                await self.handoffs.prefill_and_hand_off(msg, segmented, params, backend, fresh, gate)
            else:
                await self._serve_locally(msg, segmented, params, backend, fresh, gate)
            self.reporter.report_prompt_cached(segmented, msg.pic_backend)
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
            self.in_flight.stop(computing)
            self.streams.done(msg.request_id)
            for task_id in [msg.task_id, *msg.local_task_ids]:
                self.reporter.task_done(task_id, msg.request_id, transfers if task_id == msg.task_id else [])

    async def _prefill_here(self, msg: wire.Combine, segmented: SegmentedPrompt, gate: KVGate,
                            computing: list[str], local_keys: dict[int, str]) -> list[int]:
        """Prefill the combine's cold segments planned on this worker into its PIC store, then open ``gate``'s
        "prefill" part (on the engine thread, so the combine can run in the next step); the PIC indices of those it
        computed (their tokens are no cache hits when the combine finds them). On failure the combine computes
        them itself. Once they are stored, a peer's pin that waits for them (``computing``, which the combine
        would release only when it ends) is answered; ``local_keys``: their PIC keys (``_local_keys``)."""
        segments = [list(segmented.segment_ids(segmented.pic_segments[index])) for index in msg.compute_here]
        try:
            made = await self.kv.prefill_missing_segments(msg.pic_backend, segments, then_open=(gate, "prefill"))
        except Exception:
            logger.exception("prefilling the local segments of %s failed; the combine computes them", msg.request_id)
            return []
        finally:
            gate.open("prefill")  # (already open unless the call never ran)
        stored = [local_keys[index] for index in msg.compute_here if local_keys.get(index) in computing]
        for key in stored:
            computing.remove(key)
        self.in_flight.stop(stored)
        return [index for index, made_here in zip(msg.compute_here, made) if made_here]

    def _lead(self, segmented: SegmentedPrompt) -> list[int]:
        """The full pages of the prompt's tokens before its first PIC segment (none when the combine would not
        start after a cached prefix)."""
        pic = segmented.pic_segments
        if not pic or not self.kv.combines_start_after_prefix:
            return []
        return list(segmented.token_ids[:pic[0].start // self.kv.page_size * self.kv.page_size])

    async def _prefill_lead(self, msg: wire.Combine, lead: list[int], gate: KVGate,
                            prefix_read: asyncio.Future | None) -> int | None:
        """Once the prefix read (if any) has ended, prefill what the prefix cache lacks of ``lead`` into it, then
        open ``gate``'s "lead" part. Returns the lead's tokens the prefix cache held before; None when it held them
        all. On failure the combine computes the lead itself."""
        cached = None
        try:
            if prefix_read is not None:
                await asyncio.wait([prefix_read])  # (its failure is the combine's reads' to report)
            cached = await self.kv.cached_prefix_pages(lead) * self.kv.page_size
            if cached >= len(lead):
                return None
            cached = await self.requests.prefill_prefix(f"{engine_request_id(msg.request_id, msg.attempt)}/lead", lead)
            self.lead_tokens_prefilled += len(lead) - cached
            return cached
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("prefilling the lead of %s failed; the combine computes it", msg.request_id)
            return cached
        finally:
            gate.open("lead")

    def _fail(self, msg: wire.Combine, message: str, client_error: bool) -> None:
        self.send(msg.frontend, failure(self.name, msg, message, client_error))

    async def _serve_locally(self, msg: wire.Combine, segmented, params, backend, fresh: asyncio.Future,
                             gate: KVGate | None) -> None:
        engine_id = engine_request_id(msg.request_id, msg.attempt)
        made = None  # the prompt's counts are those of the first output: worked out once, not per token
        stream = OutputStream(self.name, msg.request_id, msg.attempt)
        async for output in self.requests.generate(engine_id, segmented, params, backend, KVPlan(gate=gate)):
            if made is None:
                made = (await fresh).tokens(segmented, output.num_prefix_cached_tokens)
                logger.debug("combine %s: first token; %d prompt tokens, %d from the prefix cache, %d PIC reused, "
                             "%d of them recomputed", msg.request_id, len(output.prompt_token_ids),
                             output.num_prefix_cached_tokens, output.num_pic_cached_tokens,
                             output.num_recomputed_tokens)
            self.send(msg.frontend, stream.message(output, fresh=made))

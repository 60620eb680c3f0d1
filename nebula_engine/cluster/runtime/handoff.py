"""Prefill -> decode hand-off of one request, both sides.

The prefill peer runs the request to its first token with its pages held, sends that token to the front end, and
hands the request to the decode peer (``Handoff``: the prompt's pages, a hybrid model's linear-attention state after
the prompt in the message itself); it releases the pages once the decode peer has read them (``HandoffDone``). If
the decode peer dies (or never confirms) first, the request is reported lost (a resumable ``Failed``) and its front
end runs it again after the token already streamed. The decode peer reserves pages, reads the prompt K/V from the
prefill peer and continues decoding; a read that fails reports the request lost the same way (recomputing here
would repeat the first token).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Callable

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.in_flight import ReadsExpected, Streams
from nebula_engine.cluster.runtime.liveness import Liveness
from nebula_engine.cluster.runtime.remote_reads import TRANSFER_TIMEOUT_S, RemoteReads, reply_unless_dead
from nebula_engine.cluster.runtime.transfer import TransferError
from nebula_engine.cluster.runtime.worker_codec import (OutputStream, decode_state, encode_state, engine_request_id,
                                                        failure, output_to_wire, params_from_wire, params_to_wire)
from nebula_engine.engine.kv_port import KVPort
from nebula_engine.engine.kv_gate import KVGate
from nebula_engine.engine.kv_plan import KVPlan
from nebula_engine.engine.request_port import RequestPort
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.kvcache.pool import OutOfPagesError
from nebula_engine.pic.segments import SegmentedPrompt

logger = logging.getLogger(__name__)

HANDOFF_TIMEOUT_S = TRANSFER_TIMEOUT_S + 5  # a live decode peer reads within its transfer timeout


class Handoffs:
    def __init__(self, name: str, kv: KVPort, requests: RequestPort, send: Callable[[str, wire.Msg], None],
                 liveness: Liveness, reads: RemoteReads, reads_expected: ReadsExpected, streams: Streams):
        self.name = name
        self.kv = kv
        self.requests = requests
        self.send = send
        self.liveness = liveness
        self.reads = reads  # the decode side reads the prompt's pages through it (and its transfer counts)
        self.reads_expected = reads_expected
        self.streams = streams
        self._handoffs: dict[str, asyncio.Future] = {}  # engine request id -> done when the decode peer has read

    # ---- prefill side ----
    async def prefill_and_hand_off(self, msg: wire.Combine, segmented: SegmentedPrompt, params: SamplingParams,
                                   backend, fresh: asyncio.Future, gate: KVGate | None) -> None:
        """``fresh``: the combine's ``MadeForRequest`` (its prompt tokens that are no cache hits)."""
        engine_id = engine_request_id(msg.request_id, msg.attempt)
        first = await self.requests.generate_held(engine_id, segmented, replace(params, max_tokens=1), backend,
                                                KVPlan(hold=True, gate=gate))
        made = (await fresh).tokens(segmented, first.num_prefix_cached_tokens)
        completion = first.outputs[0]
        done_here = completion.finish_reason == "stop" or params.max_tokens == 1
        if done_here:  # finished on its first token: nothing to hand off
            await self.requests.release_held(engine_id)
            self.send(msg.frontend, output_to_wire(self.name, msg.request_id, first, msg.attempt, fresh=made))
            return
        first.finished = False
        first.outputs[0].finish_reason = None
        first_wire = output_to_wire(self.name, msg.request_id, first, msg.attempt, handoff_to=msg.decode_peer,
                                    fresh=made)
        self.send(msg.frontend, first_wire)  # TTFT
        pages = await self.kv.held_pages(engine_id)
        state = await self.kv.held_state(engine_id)
        continued = replace(params, prompt_logprobs=None)  # the front end has them, from the first output
        handoff_done = asyncio.get_running_loop().create_future()
        self._handoffs[engine_id] = handoff_done
        self.reads_expected.set("handoffs", True)
        self.send(msg.decode_peer, wire.Handoff(
            sender=self.name, request_id=msg.request_id, attempt=msg.attempt, frontend=msg.frontend,
            prompt_token_ids=list(first.prompt_token_ids), first_token=completion.token_ids[0],
            first_logprob=completion.token_logprobs[0], params=params_to_wire(continued), pages=pages,
            cached=list(first_wire.cached), state=await encode_state(state)))
        try:
            outcome = await reply_unless_dead(self.liveness, handoff_done, msg.decode_peer, HANDOFF_TIMEOUT_S)
        finally:
            self._handoffs.pop(engine_id, None)
            self.reads_expected.set("handoffs", bool(self._handoffs))
            await self.requests.release_held(engine_id)
        if outcome != "done":
            logger.warning("decode peer %s did not take the hand-off of %s (%s)", msg.decode_peer, msg.request_id,
                           outcome)
            self.send(msg.frontend, failure(self.name, msg, f"decode peer {msg.decode_peer} did not take the "
                                            f"hand-off ({outcome})", client_error=False, resumable=True))

    def on_handoff_done(self, msg: wire.HandoffDone) -> None:
        future = self._handoffs.get(msg.request_id)
        if future is not None and not future.done():
            future.set_result(True)

    # ---- decode side ----
    async def on_handoff(self, msg: wire.Handoff) -> None:
        self.streams.serving(msg.request_id)
        params = params_from_wire(msg.params)
        prompt = list(msg.prompt_token_ids)
        engine_id = engine_request_id(msg.request_id, msg.attempt)
        try:
            try:
                state = await decode_state(msg.state)
                pages = await self.requests.reserve_prefilled(engine_id, len(prompt))
                await self.reads.read_pages(msg.sender, msg.pages[:len(pages)], pages, "handoff", len(prompt))
                stream = self.requests.generate_prefilled(engine_id, prompt, msg.first_token, msg.first_logprob,
                                                        params, tuple(msg.cached), state)
            except (TransferError, ValueError, OutOfPagesError) as error:
                self.reads.note_failure()
                logger.warning("hand-off of %s failed (%s): its front end runs it again", msg.request_id, error)
                await self.requests.cancel_prefilled(engine_id)
                self.send(msg.frontend, failure(self.name, msg, f"decode peer {self.name} could not read its KV: "
                                                f"{error}", client_error=False, resumable=True))
                return
            finally:
                self.send(msg.sender, wire.HandoffDone(sender=self.name, request_id=engine_id))
            to_frontend = OutputStream(self.name, msg.request_id, msg.attempt, first_position=1)
            async for output in stream:
                self.send(msg.frontend, to_frontend.message(output))
        except asyncio.CancelledError:
            raise
        except Exception as error:
            logger.exception("decode of %s failed", msg.request_id)
            self.send(msg.frontend, failure(self.name, msg, f"decode failed: {error!r}", client_error=False))
        finally:
            self.streams.done(msg.request_id)

"""What a worker's messages carry, to and from the engine's own types: sampling params, segmented prompts, outputs
(with their top and prompt logprobs), failures, and the state beyond pages (``PinReply.state``, ``Handoff.state``)."""

from __future__ import annotations

import asyncio
import io

import torch

from nebula_engine.cluster.runtime import wire
from nebula_engine.engine.outputs import Logprob, RequestOutput
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.structured_outputs import StructuredOutputsParams
from nebula_engine.pic.segments import PromptSegment, SegmentedPrompt, SegmentKind


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


def failure(sender: str, msg: wire.Combine | wire.Handoff, message: str, client_error: bool,
            resumable: bool = False) -> wire.Failed:
    """The ``Failed`` that tells ``msg``'s front end its attempt ended without output."""
    return wire.Failed(sender=sender, request_id=msg.request_id, attempt=msg.attempt, message=message,
                       client_error=client_error, resumable=resumable)


def candidates_to_wire(position: dict[int, Logprob]) -> list[wire.Candidate]:
    return [wire.Candidate(token_id, p.logprob, p.rank, p.decoded_token) for token_id, p in position.items()]


def candidates_from_wire(candidates: list[wire.Candidate]) -> dict[int, Logprob]:
    return {c.token_id: Logprob(c.logprob, c.rank, c.text) for c in candidates}


class OutputStream:
    """One stream of an attempt (the cumulative ``RequestOutput``s of one engine) as ``wire.Output`` messages; each
    carries the top logprobs of the tokens no earlier message of the stream carried, the first the prompt logprobs.
    ``first_position``: the attempt's token its engine's first top logprobs belong to (1 on a decode peer: the
    prefill peer sent the first token's)."""

    def __init__(self, sender: str, request_id: str, attempt: int, first_position: int = 0):
        self.sender, self.request_id, self.attempt, self.first_position = sender, request_id, attempt, first_position
        self._top_sent = 0  # of the engine's top logprobs
        self._prompt_sent = False

    def message(self, output: RequestOutput, handoff_to: str = "", fresh: tuple[int, int] = (0, 0)) -> wire.Output:
        """``fresh``: the prompt tokens the engine found cached only because they were prefilled for this request
        (PIC segments here or on another peer, the lead into the prefix cache), and how many of them the prefix
        cache held (``MadeForRequest.tokens``); they are no cache hits."""
        completion = output.outputs[0]
        prefix_hits = output.num_prefix_cached_tokens - fresh[1]
        hits = max(prefix_hits, output.num_cached_tokens - fresh[0])
        top = completion.logprobs or []
        top_start, self._top_sent = self._top_sent, len(top)
        prompt = None
        if output.prompt_logprobs is not None and not self._prompt_sent:
            prompt = [None if p is None else candidates_to_wire(p) for p in output.prompt_logprobs]
            self._prompt_sent = True
        return wire.Output(sender=self.sender, request_id=self.request_id, attempt=self.attempt, text=completion.text,
                           token_ids=list(completion.token_ids), logprobs=list(completion.token_logprobs),
                           finished=output.finished, finish_reason=completion.finish_reason,
                           stop_reason=completion.stop_reason,
                           cached=[prefix_hits, output.num_pic_cached_tokens, output.num_recomputed_tokens, hits],
                           handoff_to=handoff_to, top_logprobs=[candidates_to_wire(p) for p in top[top_start:]],
                           top_logprobs_start=self.first_position + top_start, prompt_logprobs=prompt)


def output_to_wire(sender: str, request_id: str, output: RequestOutput, attempt: int,
                   handoff_to: str = "", fresh: tuple[int, int] = (0, 0)) -> wire.Output:
    """``output`` alone as a message (everything a stream's first message carries; ``OutputStream.message``)."""
    return OutputStream(sender, request_id, attempt).message(output, handoff_to, fresh)


def state_bytes(state: dict) -> bytes:
    """The wire codec of state beyond pages (``PinReply.state``, ``Handoff.state``): tensors by torch's format,
    read back with ``weights_only`` (no arbitrary unpickling); an empty state is empty bytes."""
    if not state:
        return b""
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    return buffer.getvalue()


def state_from_bytes(data: bytes) -> dict:
    """Inverse of ``state_bytes``; ValueError for bytes that are not a saved dict (nothing else is loaded)."""
    if not data:
        return {}
    try:
        state = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:  # torch raises several types for malformed archives
        raise ValueError(f"malformed state bytes: {error}") from error
    if not isinstance(state, dict):
        raise ValueError(f"state bytes hold a {type(state).__name__}, not a dict")
    return state


async def encode_state(state: dict) -> bytes:
    """``state_bytes`` off the event loop when there is anything to encode (a hybrid's state is megabytes)."""
    return await asyncio.to_thread(state_bytes, state) if state else b""


async def decode_state(data: bytes) -> dict:
    """``state_from_bytes`` off the event loop when there is anything to decode."""
    return await asyncio.to_thread(state_from_bytes, data) if data else {}

"""Messages between peer processes and their one codec (msgpack via msgspec, tagged by type).

Every message names its sender peer. Request-scoped messages carry ``attempt``: only a request's front end starts
a new attempt (after a failure: a higher number), and it only accepts outputs of the attempt it is waiting for.
Worker cache events travel in ``CacheEventMsg`` as the KV cache's own types (``kvcache.events``), which the router
hands to the control plane's view unchanged; each carries the sequence number its worker gave it (one counter per
worker over cache events and task completions).
"""

from __future__ import annotations

import msgspec

from nebula_engine.kvcache.events import CacheEvent


class Msg(msgspec.Struct, tag=True, kw_only=True):
    sender: str


class Segment(msgspec.Struct, array_like=True):
    kind: str  # "regular" | "pic"
    start: int
    length: int


class Candidate(msgspec.Struct, array_like=True):
    """One candidate token at one position: ``outputs.Logprob`` with its token id."""

    token_id: int
    logprob: float
    rank: int | None
    text: str | None


class Params(msgspec.Struct, kw_only=True):
    """``SamplingParams`` as plain fields."""

    fields: dict


# ---- membership ----
class Hello(Msg):
    role: str  # "prefill" | "decode"
    worker_index: int  # prefill workers 0..N-1; -1 for decode peers
    nixl_metadata: bytes
    reply: bool = False  # an answer to a peer's Hello (is not answered again)


class Heartbeat(Msg):
    pass


# ---- front end <-> router ----
class Submit(Msg):
    request_id: str
    attempt: int
    token_ids: list[int]
    segments: list[Segment]
    params: Params
    pic_backend: str | None  # the backend the front end resolved, as its spec; None = PIC off
    route: str = ""  # a prefill peer that must run the combine ("" = the planner decides)


class NotLeader(Msg):
    """A router that does not lead (any more) refuses a ``Submit``; the front end submits it to the leader."""

    request_id: str
    attempt: int


# ---- router -> workers ----
class Scatter(Msg):
    task_id: str
    request_id: str
    segment_index: int
    key: str
    token_ids: list[int]
    pic_backend: str  # the request's backend spec; it names ``key``


class ScatterLead(Msg):
    """Prefill ``token_ids`` (a prompt's lead after a prefix the receiver caches) exactly into the prefix cache, for
    the combine home to read (its ``Combine.prefix_peer``)."""

    task_id: str
    request_id: str
    token_ids: list[int]


class SourceSpec(msgspec.Struct, array_like=True):
    segment_index: int
    key: str
    peer: str  # holder to fetch from ("" = this worker: local hit or compute here)
    fresh: bool = False  # the holder prefills it for this request (a scatter): reading it is no cache hit


class Combine(Msg):
    task_id: str
    request_id: str
    attempt: int
    frontend: str
    token_ids: list[int]
    segments: list[Segment]
    params: Params
    pic_backend: str | None
    sources: list[SourceSpec]
    local_task_ids: list[str]  # scatter tasks planned on this worker itself: done when the combine is
    decode_peer: str  # "" = decode here
    prefix_peer: str = ""  # a peer holding the prompt's first ``prefix_tokens`` in its prefix cache: read them
    prefix_tokens: int = 0
    compute_here: list[int] = []  # PIC indices of cold segments planned on this worker (prefilled while it fetches)
    prefix_fresh: bool = False  # ``prefix_peer`` prefills the prompt's lead for it (a ``ScatterLead``): no cache hit


class SnapshotRequest(Msg):
    pass


class PCShare(Msg):
    pc_share: float


# ---- workers -> router ----
class CacheEventMsg(Msg):
    worker_index: int
    events: list[CacheEvent]  # numbered by the worker, consecutively
    snapshot: bool = False  # True: the full index (replaces what the router knew of this worker)


class TransferTime(msgspec.Struct, array_like=True):
    """How long one segment read by a combine's home took, from its pin sent to its store."""

    peer: str  # the holder it was read from
    seconds: float
    num_tokens: int
    scattered: bool  # the holder prefilled it for this request (a scatter), else it was cached there


class TaskDone(Msg):
    worker_index: int
    task_id: str
    seq: int  # the worker's sequence number of this report (one counter with its cache events)
    request_id: str = ""
    transfers: list[TransferTime] = []  # a combine's reads, for the router's ObservedTransferCosts


# ---- worker <-> worker ----
class PinSegment(Msg):
    tag: str
    key: str
    num_tokens: int
    wait_s: float  # how long to wait for the segment to appear (a scatter prefill may be on its way)


class PinPrefix(Msg):
    """Pin the longest cached page-aligned prefix of ``token_ids`` in the receiver's prefix cache."""

    tag: str
    token_ids: list[int]


class UnpinPrefix(Msg):
    tag: str


class PinReply(Msg):
    tag: str
    ok: bool
    pages: list[int] = []
    state: bytes = b""


class Unpin(Msg):
    key: str


class Handoff(Msg):
    request_id: str
    attempt: int
    frontend: str
    prompt_token_ids: list[int]
    first_token: int
    first_logprob: float
    params: Params
    pages: list[int]  # on the sender, holding the prompt's K/V
    cached: list[int]  # prefix, PIC, recomputed token counts, then the cache hits (KV that existed before it)
    # hybrid models: the linear-attention state after the prompt, in PinReply.state's codec (empty otherwise).
    # It travels in this message for now, as PinReply.state does; reading it by NIXL with the pages is a later step.
    state: bytes = b""


class HandoffDone(Msg):
    request_id: str


# ---- to the front end ----
class Output(Msg):
    request_id: str
    attempt: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    cached: list[int]  # prefix, PIC, recomputed token counts, then the cache hits (KV that existed before it)
    handoff_to: str = ""  # the decode peer this request moves to next: it carries the request from now on
    # when logprobs were asked: the candidates of the attempt's tokens ``top_logprobs_start``, ``+ 1``, ... (those
    # an earlier output of this stream did not carry)
    top_logprobs: list[list[Candidate]] = []
    top_logprobs_start: int = 0
    # when asked, in a stream's first output only: per prompt token its candidates (None for the first)
    prompt_logprobs: list[list[Candidate] | None] | None = None


class Failed(Msg):
    request_id: str
    attempt: int
    message: str
    client_error: bool  # True: the request's fault (HTTP 400)
    resumable: bool = False  # True: a peer it needed is gone; the front end runs it again (continuing its output)


class Abort(Msg):
    request_id: str


MESSAGE = (Hello | Heartbeat | Submit | NotLeader | Scatter | ScatterLead | Combine | SnapshotRequest | PCShare
           | CacheEventMsg | TaskDone | PinSegment | PinPrefix | PinReply | Unpin | UnpinPrefix | Handoff | HandoffDone
           | Output | Failed | Abort)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(MESSAGE)


def encode(message: Msg) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Msg:
    return _decoder.decode(data)

"""Turning per-session message lists into requests, interleaving sessions on a shared clock."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nebula_engine.workloads.arrivals import session_start_times
from nebula_engine.workloads.request import Request, Segment

SESSION_MEAN_GAP_S = 30.0  # mean gap between session starts (Poisson)
TURN_GAP_S = 5.0  # time between consecutive LLM calls of one session


@dataclass(frozen=True)
class SessionCalls:
    """The LLM calls of one session: each call's full input, in call order."""

    session_id: str
    calls: tuple[tuple[Segment, ...], ...]
    call_offsets_s: tuple[float, ...] | None = None  # logged times from the session start, if any
    call_metadata: tuple[dict, ...] | None = None  # per call, copied into Request.metadata


def interleave_sessions(sessions: Sequence[SessionCalls], seed: int) -> list[Request]:
    """Requests from all sessions sorted by arrival: sessions start as a seeded Poisson process."""
    starts = session_start_times(len(sessions), SESSION_MEAN_GAP_S, seed)
    requests = []
    for start, session in zip(starts, sessions):
        offsets = session.call_offsets_s or tuple(TURN_GAP_S * i for i in range(len(session.calls)))
        metadata = session.call_metadata or tuple({} for _ in session.calls)
        for index, (offset, segments) in enumerate(zip(offsets, session.calls)):
            requests.append(Request(
                request_id=f"{session.session_id}/{index}",
                arrival_time=start + offset,
                session_id=session.session_id,
                segments=segments,
                metadata=dict(metadata[index]),
            ))
    requests.sort(key=lambda r: r.arrival_time)
    return requests

"""SWE-agent proxies: the 13 SWE-agent ``.traj`` demonstrations and the mini-swe-agent archive.

nebius/SWE-agent-trajectories (the paper's source) is not available; both proxies share its layout.
One trajectory = one session; one request per assistant message, whose input is every earlier
message: the system prompt (prefix), the task and demonstrations before the first action (regular),
then actions (regular) and environment observations (pic), as the paper counts observations as the
reusable content.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

from nebula_engine.workloads.request import Request, Segment, SegmentKind
from nebula_engine.workloads.segments import LoadOptions, SegmentFactory
from nebula_engine.workloads.sessions import SessionCalls, interleave_sessions

TRAJ_GLOB = "*.traj"
MINI_SWE_ARCHIVE = "mini_swe_agent_gemini3pro_swebench_verified_trajs.tar.gz"
MINI_SWE_SUFFIX = ".traj.json"

Message = tuple[str, str]  # (role, text)


def message_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def read_messages(trajectory: dict) -> list[Message]:
    """``history`` of a SWE-agent .traj, or ``messages`` of a mini-swe-agent .traj.json."""
    raw = trajectory.get("history") or trajectory.get("messages") or []
    return [(m["role"], message_text(m.get("content"))) for m in raw]


def segment_kind(role: str, seen_action: bool) -> SegmentKind:
    if role == "system":
        return SegmentKind.PREFIX
    if role in ("user", "tool") and seen_action:
        return SegmentKind.PIC
    return SegmentKind.REGULAR


def trajectory_calls(messages: list[Message], factory: SegmentFactory) -> tuple[tuple[Segment, ...], ...]:
    history: list[Segment] = []
    calls = []
    seen_action = False
    for role, text in messages:
        if role == "assistant":
            calls.append(tuple(history))
            seen_action = True
        history.append(factory.from_text(segment_kind(role, seen_action), text))
    return tuple(calls)


def iter_trajectories(directory: Path) -> Iterator[tuple[str, dict]]:
    """(name, trajectory): the .traj files first, then the archive, streamed member by member."""
    for path in sorted(directory.glob(TRAJ_GLOB)):
        yield path.stem, json.loads(path.read_text(encoding="utf-8"))
    archive = directory / MINI_SWE_ARCHIVE
    if not archive.exists():
        return
    with tarfile.open(archive, "r|gz") as members:
        for member in members:
            if member.isfile() and member.name.endswith(MINI_SWE_SUFFIX):
                name = Path(member.name).name.removesuffix(MINI_SWE_SUFFIX)
                yield name, json.load(members.extractfile(member))


def load_swe_agent(directory: Path, options: LoadOptions) -> list[Request]:
    """``options.limit`` bounds the number of trajectories read."""
    factory = SegmentFactory(options)
    sessions = [SessionCalls(f"swe-{name}", trajectory_calls(read_messages(trajectory), factory))
                for name, trajectory in islice(iter_trajectories(directory), options.limit)]
    return interleave_sessions(sessions, options.seed)

"""ChatDev (OpenBMB/ChatDev WareHouse run logs): one request per logged LLM call.

Inside a phase chat, call j is answered by the agent whose system prompt opens the message it answers,
so its input is: that system prompt (prefix) + the chat's opening phase prompt + messages 0..j-1.
Artifacts embedded in the phase prompt (code files, ideas, comments, test reports) are pic segments;
the template text around them is regular. Messages are pic segments (content shared across agents),
with their code blocks split out as well so a file reappearing in a later phase prompt is the same
segment. Each request keeps the logged ``prompt_tokens`` in its metadata to validate the rebuild.
A logged call with no chat around it becomes a single regular segment of the logged size.
"""

from __future__ import annotations

from pathlib import Path

from nebula_engine.workloads.analysis import LOGGED_PROMPT_TOKENS
from nebula_engine.workloads.artifacts import split_artifacts
from nebula_engine.workloads.chatdev_log import Chat, ChatMessage, LoggedCall, parse_chats
from nebula_engine.workloads.request import Request, Segment, SegmentKind
from nebula_engine.workloads.segments import LoadOptions, SegmentFactory
from nebula_engine.workloads.sessions import SessionCalls, interleave_sessions

LOG_GLOB = "WareHouse/*.log"


def text_segments(factory: SegmentFactory, text: str, template_kind: SegmentKind) -> list[Segment]:
    return [factory.from_text(SegmentKind.PIC if is_artifact else template_kind, piece)
            for is_artifact, piece in split_artifacts(text)]


def chat_calls(chat: Chat, factory: SegmentFactory) -> list[tuple[tuple[Segment, ...], LoggedCall]]:
    opening = text_segments(factory, chat.opening.text, SegmentKind.REGULAR)
    answered: list[ChatMessage] = [chat.opening, *chat.messages]
    calls = []
    history: list[Segment] = []
    for index, call in enumerate(chat.calls):
        system_prompt = answered[min(index, len(answered) - 1)].system_prompt
        prefix = [factory.from_text(SegmentKind.PREFIX, system_prompt)] if system_prompt else []
        calls.append((tuple(prefix + opening + history), call))
        if index < len(chat.messages):
            history += text_segments(factory, chat.messages[index].text, SegmentKind.PIC)
    return calls


def log_session(path: Path, factory: SegmentFactory) -> SessionCalls:
    chats, orphan_calls = parse_chats(path.read_text(encoding="utf-8", errors="replace"))
    calls = [pair for chat in chats for pair in chat_calls(chat, factory)]
    calls += [(_unlogged_input(path, n, call), call) for n, call in enumerate(orphan_calls)]
    calls.sort(key=lambda pair: pair[1].time_s)
    return SessionCalls(
        session_id=path.stem,
        calls=tuple(segments for segments, _ in calls),
        call_offsets_s=tuple(call.time_s for _, call in calls),
        call_metadata=tuple({LOGGED_PROMPT_TOKENS: call.prompt_tokens} for _, call in calls),
    )


def _unlogged_input(path: Path, index: int, call: LoggedCall) -> tuple[Segment, ...]:
    return (Segment(SegmentKind.REGULAR, f"chatdev-unlogged:{path.stem}:{index}", call.prompt_tokens),)


def load_chatdev(directory: Path, options: LoadOptions) -> list[Request]:
    """``options.limit`` bounds the number of run logs (in file-name order)."""
    factory = SegmentFactory(options)
    sessions = [log_session(path, factory) for path in sorted(directory.glob(LOG_GLOB))[:options.limit]]
    return interleave_sessions([s for s in sessions if s.calls], options.seed)

"""Parsing a ChatDev WareHouse run log into chats: who said what, and each logged LLM call.

A log is a sequence of entries ``[YYYY-DD-MM HH:MM:SS INFO] <header>\\n<body>``. Used entries:
``<Role>: **[Start Chat]**`` opens a phase chat (``[<system prompt>]`` then the phase prompt);
``<Role>: **<A><-><B> on : <Phase>, turn <n>**`` is one message (``[<system prompt of the agent
that answers it>]`` then the text); ``**[OpenAI_Usage_Info Receive]**`` (or Claude_) is one LLM call
with its ``prompt_tokens``. The run logs a call before the message it produced. Logs in the early
July-2023 format (``[OpenAI_Usage_Info]`` with ANSI-coloured ``AI User`` lines) have no such entries
and yield no calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ENTRY_START = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) INFO\] ", re.MULTILINE)
START_CHAT = re.compile(r"^[^\n*]*: \*\*\[Start Chat\]\*\*")
TURN_MESSAGE = re.compile(r"^[^\n*]*: \*\*[^\n*]*<->[^\n*]* on : [^\n*]*, turn \d+\*\*")
USAGE = re.compile(r"^\*\*\[(?:OpenAI|Claude)_Usage_Info Receive\]\*\*\s*prompt_tokens: (\d+)")
SECONDS_PER_DAY = 86_400


@dataclass(frozen=True)
class ChatMessage:
    system_prompt: str  # of the agent that answers this message
    text: str


@dataclass(frozen=True)
class LoggedCall:
    time_s: float  # from the first entry of the log
    prompt_tokens: int


@dataclass
class Chat:
    """One phase chat: the opening message, later messages, and the calls made inside it."""

    opening: ChatMessage
    messages: list[ChatMessage] = field(default_factory=list)
    calls: list[LoggedCall] = field(default_factory=list)


def split_system_prompt(body: str) -> ChatMessage:
    body = body.strip("\n")
    if body.startswith("["):
        end = body.find("]\n\n")
        if end >= 0:
            return ChatMessage(body[1:end], body[end + 3:].strip())
    return ChatMessage("", body.strip())


def iter_entries(log_text: str):
    """Yield (seconds since the first entry, header + body) for every entry."""
    matches = list(ENTRY_START.finditer(log_text))
    offsets = elapsed_seconds([match.group(1)[-8:] for match in matches])
    for offset, match, following in zip(offsets, matches, [*matches[1:], None]):
        end = following.start() if following else len(log_text)
        yield offset, log_text[match.end():end]


def elapsed_seconds(times_of_day: list[str]) -> list[float]:
    """Offsets from the first ``HH:MM:SS``. Dates are ignored: logs mix day-first and month-first
    dates, and a run is shorter than a day, so a clock that goes backwards means midnight passed."""
    offsets, elapsed, previous = [], 0.0, None
    for stamp in times_of_day:
        hours, minutes, seconds = (int(part) for part in stamp.split(":"))
        now = hours * 3600 + minutes * 60 + seconds
        if previous is not None:
            elapsed += (now - previous) % SECONDS_PER_DAY
        offsets.append(elapsed)
        previous = now
    return offsets


def parse_chats(log_text: str) -> tuple[list[Chat], list[LoggedCall]]:
    """Chats in log order, plus calls logged outside any chat (kept so no logged call is lost)."""
    chats: list[Chat] = []
    orphan_calls: list[LoggedCall] = []
    for when, entry in iter_entries(log_text):
        header, _, body = entry.partition("\n")
        if START_CHAT.match(header):
            chats.append(Chat(split_system_prompt(body)))
        elif TURN_MESSAGE.match(header) and chats:
            chats[-1].messages.append(split_system_prompt(body))
        elif usage := USAGE.match(entry):
            call = LoggedCall(when, int(usage.group(1)))
            (chats[-1].calls if chats else orphan_calls).append(call)
    return chats, orphan_calls

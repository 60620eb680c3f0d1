"""tau-bench Retail: the 69 real GPT-4o retail conversations (few-shot file of sierra-research/tau-bench).

One conversation = one session; one request per assistant turn (``assistant: None`` lines are
tool-call turns, still LLM calls). Request k = the retail policy (wiki.md, prefix) + every earlier
message as its own segment. Tool outputs are the position-independent content the paper counts
(database records); user and assistant turns are pic segments too, as agent messages.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from nebula_engine.workloads.request import Request, Segment, SegmentKind
from nebula_engine.workloads.segments import LoadOptions, SegmentFactory
from nebula_engine.workloads.sessions import SessionCalls, interleave_sessions

CONVERSATIONS_FILE = "MockRetailDomainEnv-few_shot.jsonl"
POLICY_FILE = "wiki.md"
ROLE_LINE = re.compile(r"^(user|assistant|tool): ", re.MULTILINE)


def split_messages(messages_display: str) -> list[tuple[str, str]]:
    """``"user: hi\\nassistant: ..."`` -> [(role, text)]; a message runs until the next role line."""
    starts = list(ROLE_LINE.finditer(messages_display))
    messages = []
    for match, following in zip(starts, [*starts[1:], None]):
        end = following.start() if following else len(messages_display)
        messages.append((match.group(1), messages_display[match.end():end].rstrip("\n")))
    return messages


def conversation_calls(policy: Segment, messages: list[tuple[str, str]],
                       factory: SegmentFactory) -> tuple[tuple[Segment, ...], ...]:
    history = [policy]
    calls = []
    for role, text in messages:
        if role == "assistant":
            calls.append(tuple(history))
        history.append(factory.from_text(SegmentKind.PIC, f"{role}: {text}"))
    return tuple(calls)


def load_tau_bench(directory: Path, options: LoadOptions) -> list[Request]:
    """``options.limit`` bounds the number of conversations."""
    factory = SegmentFactory(options)
    policy = factory.from_text(SegmentKind.PREFIX, (directory / POLICY_FILE).read_text(encoding="utf-8"))
    sessions = []
    with (directory / CONVERSATIONS_FILE).open(encoding="utf-8") as lines:
        for index, line in enumerate(lines):
            if options.limit is not None and index >= options.limit:
                break
            messages = split_messages(json.loads(line)["messages_display"])
            sessions.append(SessionCalls(f"tau-{index}", conversation_calls(policy, messages, factory)))
    return interleave_sessions(sessions, options.seed)

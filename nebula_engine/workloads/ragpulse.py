"""RAGPulse (github.com/flashserve/RAGPulse): one request per trace line, in file order.

Segments in order sys_prompt (prefix), passages, history, web_search (pic), user_input (regular).
The trace holds only token lengths (Qwen2.5 tokens); token ids are synthesized per content id when
asked, so the same id always yields the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from nebula_engine.workloads.request import Request, SegmentKind
from nebula_engine.workloads.segments import LoadOptions, SegmentFactory, trace_content_id

TRACE_FILE = "0_trace.jsonl"

# trace field -> (length file, id key in that file, segment kind), in request order
FIELDS: dict[str, tuple[str, str, SegmentKind]] = {
    "sys_prompt": ("1_sys_prompt.jsonl", "sys_prompt_id", SegmentKind.PREFIX),
    "passages_ids": ("2_passages.jsonl", "passage_id", SegmentKind.PIC),
    "history": ("3_history.jsonl", "history_id", SegmentKind.PIC),
    "web_search": ("5_web_search.jsonl", "web_search_id", SegmentKind.PIC),
    "user_input": ("4_user_input.jsonl", "user_input_id", SegmentKind.REGULAR),
}
REQUIRED_FILES = (TRACE_FILE, *(length_file for length_file, _, _ in FIELDS.values()))


def read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                rows.append(json.loads(line))
    return rows


def read_token_lengths(directory: Path) -> dict[str, dict[int, int]]:
    """field -> {trace id: token length}."""
    lengths = {}
    for field, (length_file, id_key, _) in FIELDS.items():
        lengths[field] = {row[id_key]: row["token_length"] for row in read_jsonl(directory / length_file)}
    return lengths


def load_ragpulse(directory: Path, options: LoadOptions) -> list[Request]:
    """``options.limit`` bounds the number of trace lines read."""
    lengths = read_token_lengths(directory)
    factory = SegmentFactory(options)
    requests = []
    for line_no, row in enumerate(read_jsonl(directory / TRACE_FILE, options.limit)):
        segments = []
        for field, (_, _, kind) in FIELDS.items():
            for trace_id in row["hash_ids"].get(field, []):
                content_id = trace_content_id(field, trace_id)
                segments.append(factory.from_trace(kind, content_id, lengths[field][trace_id]))
        requests.append(Request(
            request_id=f"ragpulse-{line_no}",
            arrival_time=float(row["timestamp"]),
            session_id=row["session_id"],
            segments=tuple(segments),
            output_tokens=int(row["output_length"]),
            metadata={"input_length": int(row["input_length"])},
        ))
    return requests

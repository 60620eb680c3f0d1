"""Split a prompt into PIC and regular segments and tokenize each segment on its own.

Text inside ``<pic>...</pic>`` is a PIC segment; each maximal unmarked span is a regular segment; the tags
themselves never reach the tokenizer. Every segment is tokenized alone and the ids are concatenated, so a
PIC segment has the same ids wherever it appears (its cache key is a function of its ids).

Invariant — PIC on/off does not change the ids: PIC off means ``SegmentedPrompt.without_pic()`` on the
same segmentation, which keeps ``token_ids`` and only relabels segments. The ids may differ from tokenizing
the tag-stripped text in one go (a BPE merge across a segment boundary is lost), which is why the
per-segment tokenization is used in both modes rather than only when PIC is on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Iterable, Sequence

Encoder = Callable[[str], list[int]]  # text -> ids, adding no special tokens
Message = dict[str, Any]
ChatRenderer = Callable[[list[Message]], str]  # messages -> prompt text (the chat template)

_TAG = re.compile(r"</?pic>")
# Private-use code points: a template has no reason to emit or alter them (not whitespace, not markup).
_SENTINEL_OPEN, _SENTINEL_CLOSE = "\ue000", "\ue001"
_SENTINEL = re.compile(f"{_SENTINEL_OPEN}(\\d+){_SENTINEL_CLOSE}")


class SegmentKind(str, Enum):
    """What a segment is to caching; the engine's prompts hold only ``REGULAR`` and ``PIC`` segments."""

    PREFIX = "prefix"  # a workload's shared leading text (system prompt): regular text reused through prefix caching
    REGULAR = "regular"  # ordinary text: reused only as part of an exact prefix
    PIC = "pic"  # position-independent segment: reusable at any position


_PREFIX_IN_PROMPT = "a prompt's segments are 'regular' or 'pic' (a workload's prefix is regular text to the engine)"


class PICSyntaxError(ValueError):
    """Malformed ``<pic>`` markup; ``position`` is a character offset into the text (the message's content
    for chat, ``message_index`` naming the message)."""

    def __init__(self, reason: str, position: int, message_index: int | None = None):
        where = f"character {position}" + ("" if message_index is None else f" of message {message_index}")
        super().__init__(f"{reason} at {where}")
        self.reason, self.position, self.message_index = reason, position, message_index


@dataclass(frozen=True)
class TextSegment:
    kind: SegmentKind
    text: str


@dataclass(frozen=True)
class PromptSegment:
    kind: SegmentKind
    start: int  # offset into SegmentedPrompt.token_ids
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class SegmentedPrompt:
    """Token ids and the segments that tile them, in order, without gaps; every segment is non-empty and regular
    or PIC."""

    token_ids: tuple[int, ...]
    segments: tuple[PromptSegment, ...]

    def __post_init__(self) -> None:
        offset = 0
        for segment in self.segments:
            if segment.kind is SegmentKind.PREFIX:
                raise ValueError(_PREFIX_IN_PROMPT)
            if segment.start != offset or segment.length <= 0:
                raise ValueError(f"segments must tile token_ids without gaps or empty segments: {self.segments}")
            offset = segment.end
        if offset != len(self.token_ids):
            raise ValueError(f"segments cover {offset} tokens, prompt has {len(self.token_ids)}")

    @property
    def pic_segments(self) -> tuple[PromptSegment, ...]:
        return tuple(s for s in self.segments if s.kind is SegmentKind.PIC)

    def segment_ids(self, segment: PromptSegment) -> tuple[int, ...]:
        return self.token_ids[segment.start:segment.end]

    def without_pic(self) -> SegmentedPrompt:
        """PIC switched off: identical ``token_ids``, one regular segment."""
        return SegmentedPrompt(self.token_ids, (PromptSegment(SegmentKind.REGULAR, 0, len(self.token_ids)),))


def parse_pic_tags(text: str, message_index: int | None = None) -> list[TextSegment]:
    """Tagged and unmarked spans of ``text`` in order, tags removed; empty unmarked spans are dropped."""
    spans: list[TextSegment] = []
    cursor, open_at = 0, None  # open_at: offset of the unclosed <pic>, None outside a tag pair
    for tag in _TAG.finditer(text):
        if tag.group() == "<pic>":
            if open_at is not None:
                raise PICSyntaxError("nested <pic>", tag.start(), message_index)
            if tag.start() > cursor:
                spans.append(TextSegment(SegmentKind.REGULAR, text[cursor:tag.start()]))
            open_at = tag.start()
        else:
            if open_at is None:
                raise PICSyntaxError("</pic> without <pic>", tag.start(), message_index)
            if tag.start() == open_at + len("<pic>"):
                raise PICSyntaxError("empty <pic></pic>", open_at, message_index)
            spans.append(TextSegment(SegmentKind.PIC, text[open_at + len("<pic>"):tag.start()]))
            open_at = None
        cursor = tag.end()
    if open_at is not None:
        raise PICSyntaxError("unclosed <pic>", open_at, message_index)
    if cursor < len(text):
        spans.append(TextSegment(SegmentKind.REGULAR, text[cursor:]))
    return spans


def segment_token_lists(segments: Iterable[tuple[SegmentKind | str, Sequence[int]]],
                        bos_token_id: int | None = None) -> SegmentedPrompt:
    """Explicit segments as (kind, ids) pairs (benchmarks); adjacent regular segments merge into one, empty
    regular segments vanish, and ``bos_token_id`` opens the first regular segment."""
    token_ids: list[int] = [] if bos_token_id is None else [bos_token_id]
    out: list[PromptSegment] = [PromptSegment(SegmentKind.REGULAR, 0, 1)] if token_ids else []
    for kind, ids in segments:
        kind = SegmentKind(kind)
        if kind is SegmentKind.PREFIX:
            raise ValueError(_PREFIX_IN_PROMPT)
        if kind is SegmentKind.PIC and not ids:
            raise ValueError("a PIC segment must have at least one token")
        if not ids:
            continue
        if kind is SegmentKind.REGULAR and out and out[-1].kind is SegmentKind.REGULAR:
            out[-1] = PromptSegment(SegmentKind.REGULAR, out[-1].start, out[-1].length + len(ids))
        else:
            out.append(PromptSegment(kind, len(token_ids), len(ids)))
        token_ids.extend(int(i) for i in ids)
    return SegmentedPrompt(tuple(token_ids), tuple(out))


def tokenize_segments(spans: Iterable[TextSegment], encode: Encoder,
                      bos_token_id: int | None = None) -> SegmentedPrompt:
    """Each span through ``encode`` alone, then concatenated (see the module doc for why)."""
    pairs = []
    for span in spans:
        ids = encode(span.text)
        if span.kind is SegmentKind.PIC and not ids:
            raise ValueError(f"PIC segment {span.text!r} tokenizes to no tokens")
        pairs.append((span.kind, ids))
    return segment_token_lists(pairs, bos_token_id)


def segment_prompt(text: str, encode: Encoder, bos_token_id: int | None = None) -> SegmentedPrompt:
    """A completion prompt with ``<pic>`` tags; ``encode`` must add no special tokens (BOS comes from
    ``bos_token_id``, once, at the very start)."""
    return tokenize_segments(parse_pic_tags(text), encode, bos_token_id)


def segment_chat(messages: Sequence[Message], render: ChatRenderer, encode: Encoder,
                 bos_token_id: int | None = None) -> SegmentedPrompt:
    """A conversation whose message contents carry ``<pic>`` tags, rendered by the chat template.

    Each tagged span is swapped for a sentinel before rendering, so the template's own text and the
    unmarked content form regular segments while each span is tokenized alone, the same ids wherever it
    appears (a template that repeats a message repeats its segments; one that drops a message drops them).
    ``render`` is e.g. ``lambda m: tokenizer.apply_chat_template(m)[0]``. Templates write BOS themselves, so
    ``encode`` must add no special tokens; ``bos_token_id`` is only for templates that do not.
    """
    pic_texts: list[str] = []
    masked = [_mask_message(message, index, pic_texts) for index, message in enumerate(messages)]
    rendered = render(masked)
    spans: list[TextSegment] = []
    cursor = 0
    for sentinel in _SENTINEL.finditer(rendered):
        if sentinel.start() > cursor:
            spans.append(TextSegment(SegmentKind.REGULAR, rendered[cursor:sentinel.start()]))
        spans.append(TextSegment(SegmentKind.PIC, pic_texts[int(sentinel.group(1))]))
        cursor = sentinel.end()
    spans.append(TextSegment(SegmentKind.REGULAR, rendered[cursor:]))
    for span in spans:
        if span.kind is SegmentKind.REGULAR and (_SENTINEL_OPEN in span.text or _SENTINEL_CLOSE in span.text):
            raise ValueError("the chat template altered a PIC placeholder; cannot locate PIC segments")
    return tokenize_segments((s for s in spans if s.text), encode, bos_token_id)


def _mask_message(message: Message, index: int, pic_texts: list[str]) -> Message:
    """``message`` with each tagged span of its content replaced by a sentinel naming ``pic_texts[i]``."""
    content = message.get("content")
    if content is None:
        return dict(message)
    if not isinstance(content, str):
        raise TypeError(f"message {index}: <pic> segmentation needs string content, got {type(content).__name__}")
    if _SENTINEL_OPEN in content or _SENTINEL_CLOSE in content:
        raise ValueError(f"message {index}: content holds U+E000/U+E001, reserved for PIC placeholders")
    parts = []
    for span in parse_pic_tags(content, index):
        if span.kind is SegmentKind.PIC:
            parts.append(f"{_SENTINEL_OPEN}{len(pic_texts)}{_SENTINEL_CLOSE}")
            pic_texts.append(span.text)
        else:
            parts.append(span.text)
    return {**message, "content": "".join(parts)}

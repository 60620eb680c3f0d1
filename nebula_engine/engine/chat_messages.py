"""OpenAI chat messages to what a chat template renders: content-part arrays flattened to text.

``flatten_content_parts`` is shared by ``LLM.chat`` and the HTTP server, so both accept and refuse the same
messages with the same errors.
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]

TEXT_PART_TYPES = ("text", "input_text")  # chat completions' and the Responses API's names for a text part
MEDIA_PART_TYPES = ("image_url", "image", "input_image", "input_audio", "audio_url", "video_url", "file")


def flatten_content_parts(messages: list[Message]) -> list[Message]:
    """``messages`` with each list of content parts replaced by its text parts joined with newlines (as vLLM
    renders content for templates that take string content); string and null contents stay as they are.

    ValueError naming the message and part for an image or other media part (this engine serves text models),
    an unknown part type, or a part that is not an object with a string ``text``."""
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of message objects, got {type(messages).__name__}")
    flattened = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {index} must be an object with a role and content, got {type(message).__name__}")
        content = message.get("content")
        if isinstance(content, list):
            message = {**message, "content": "\n".join(_part_text(index, i, part) for i, part in enumerate(content))}
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"message {index}: content must be a string, a list of content parts or null, "
                             f"got {type(content).__name__}")
        flattened.append(message)
    return flattened


def _part_text(message_index: int, part_index: int, part: object) -> str:
    where = f"message {message_index}, content part {part_index}"
    if not isinstance(part, dict):
        raise ValueError(f"{where}: a content part is an object with a type, got {type(part).__name__}")
    kind = part.get("type")
    if kind in MEDIA_PART_TYPES:
        raise ValueError(f"{where}: {kind!r} parts need a multimodal model; this engine serves text-only models")
    if kind not in TEXT_PART_TYPES:
        raise ValueError(f"{where}: unknown content part type {kind!r} (expected 'text')")
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}: a text part needs a string 'text'")
    return text

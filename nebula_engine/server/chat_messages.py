"""Validated chat messages and tools -> the dicts a Hugging Face chat template reads.

Content parts become one string (``engine.chat_messages.flatten_content_parts``, shared with ``LLM.chat``: text
parts joined by newlines, as vLLM does for string-content templates; media parts refused by name), so ``<pic>``
tags in any message kind (system, user, assistant, tool results) are segmented the same way. An
assistant's ``tool_calls`` keep OpenAI's shape but with ``arguments`` parsed into an object, as templates render
them with ``| tojson`` (vLLM does the same); a ``tool`` message keeps its ``tool_call_id``.
"""

from __future__ import annotations

import json
from typing import Any

from nebula_engine.engine.chat_messages import flatten_content_parts
from nebula_engine.server.errors import APIError
from nebula_engine.server.protocol import ChatMessage, Tool

TemplateMessage = dict[str, Any]


def template_messages(messages: list[ChatMessage]) -> list[TemplateMessage]:
    try:
        return flatten_content_parts([_template_message(index, m) for index, m in enumerate(messages)])
    except ValueError as exc:
        raise APIError(str(exc), param="messages") from exc


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """OpenAI tool definitions as ``apply_chat_template(tools=...)`` takes them (the same JSON shape)."""
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True, by_alias=True) for tool in tools]


def _template_message(index: int, message: ChatMessage) -> TemplateMessage:
    out: TemplateMessage = {"role": message.role, "content": message.content if message.content is not None else ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": call.type,
                              "function": {"name": call.function.name,
                                           "arguments": _arguments(index, call.function.arguments)}}
                             for call in message.tool_calls]
    return out


def _arguments(index: int, arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise APIError(f"messages[{index}].tool_calls: arguments must be a JSON string ({exc})",
                       param="messages") from exc

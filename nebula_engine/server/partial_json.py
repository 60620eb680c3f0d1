"""JSON text that is still being generated -> the part of its final serialisation that is already fixed.

A streamed tool call sends its arguments as the model writes them, and the pieces must add up to the string the
whole call carries: ``json.dumps(value, ensure_ascii=False)`` of the finished value (``tool_parsers``).
``fixed_prefix`` re-serialises the text token by token with ``json.dumps``'s separators, emitting a token only once
nothing that follows can change it: strings as their characters arrive (an escape once whole), numbers and
``true`` / ``false`` / ``null`` once something ends them. For JSON without repeated object keys the result of a whole
value is exactly ``json.dumps(json.loads(text), ensure_ascii=False)``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = "0123456789.eE+-"
_LITERALS = ("true", "false", "null")
_WHITESPACE = " \t\n\r"
_ESCAPE_LENGTHS = {"u": 6}  # \uXXXX; every other escape is two characters


@dataclass(frozen=True)
class FixedPrefix:
    text: str  # the fixed part of the value's serialisation
    end: int | None  # where the value ends in the input, once it is whole; None while it is not (or is not JSON)


def fixed_prefix(raw: str, at: int = 0) -> FixedPrefix:
    """The fixed part of the serialisation of the JSON value that starts at ``raw[at:]`` (spaces skipped)."""
    out: list[str] = []
    depth = 0
    i = _skip_spaces(raw, at)
    while i < len(raw):
        char = raw[i]
        if char in "{[":
            out.append(char)
            depth += 1
            i += 1
        elif char in "}]":
            if depth == 0:
                return FixedPrefix("".join(out), None)
            out.append(char)
            depth -= 1
            i += 1
        elif char in ",:" and depth > 0:
            out.append(char + " ")
            i += 1
        elif char == '"':
            token, end = _string(raw, i)
            out.append(token)
            if end is None:
                return FixedPrefix("".join(out), None)
            i = end
        else:
            token, end = _scalar(raw, i)
            if end is None:
                return FixedPrefix("".join(out), None)
            out.append(token)
            i = end
        if depth == 0:
            return FixedPrefix("".join(out), i)
        i = _skip_spaces(raw, i)
    return FixedPrefix("".join(out), None)


def _skip_spaces(raw: str, i: int) -> int:
    while i < len(raw) and raw[i] in _WHITESPACE:
        i += 1
    return i


def _string(raw: str, start: int) -> tuple[str, int | None]:
    """(serialisation so far, end) of the string opening at ``raw[start]``; a string not closed yet gives its
    characters up to the last whole escape, without the closing quote, and end None."""
    i = start + 1
    while i < len(raw):
        if raw[i] == "\\":
            size = _ESCAPE_LENGTHS.get(raw[i + 1], 2) if i + 1 < len(raw) else 2
            if i + size > len(raw):
                break
            i += size
        elif raw[i] == '"':
            token = _dumps(raw[start:i + 1])
            return (token, i + 1) if token is not None else ("", None)
        else:
            i += 1
    body = raw[start + 1:i]
    try:
        decoded = json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return "", None  # not JSON: nothing of it is fixed
    if decoded and "\ud800" <= decoded[-1] <= "\udbff":  # half a surrogate pair: its character is not known yet
        decoded = decoded[:-1]
    return json.dumps(decoded, ensure_ascii=False)[:-1], None


def _scalar(raw: str, i: int) -> tuple[str, int | None]:
    """A number or literal at ``raw[i]`` and its end; end None until a character after it shows it is whole."""
    number = _NUMBER.match(raw, i)
    if number is not None:
        end = number.end()
        if end == len(raw) or raw[end] in _NUMBER_CHARS:  # "2" of "2.5", or "2." itself: more may follow
            return "", None
        return _dumps(number.group()), end
    for literal in _LITERALS:
        if raw.startswith(literal, i):
            return literal, i + len(literal)
    return "", None


def _dumps(token: str) -> str | None:
    """``token`` re-serialised, None if it is not JSON."""
    try:
        return json.dumps(json.loads(token), ensure_ascii=False)
    except json.JSONDecodeError:
        return None

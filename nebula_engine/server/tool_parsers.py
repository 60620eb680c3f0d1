"""Tool calls in a model's output text, one parser per model family's format.

- ``hermes`` (Qwen2.5 / Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers) or
  ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11+);
- ``llama3_json`` (Llama 3.1+ JSON tool calling): the whole output is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several separated by ``;``.

The HTTP API sees only the tokenizer (of a local engine or of a cluster), so the family is recognised by what
its chat template writes (``parser_for_template``); ``nebula-engine serve --tool-call-parser`` names one
explicitly, as vLLM's flag does. Text before the first call is content; arguments are re-serialised with
``json.dumps`` (as vLLM does). A call whose JSON does not parse ends the calls: if none parsed, the whole output
is content. ``partial_calls`` reads the calls as far as they are written, for streams that send arguments as they
are generated (``tool_streaming``).
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from nebula_engine.server.partial_json import fixed_prefix

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class PartialCall:
    """A call as far as the model has written it."""

    name: str | None  # once written whole
    arguments: str  # the raw text of its arguments so far ("" until they begin)
    end: int | None = None  # where its JSON object ends in the text it was read from, once whole


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    calls: tuple[ParsedCall, ...]


class ToolParser(ABC):
    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]  # texts that open the tool-call part of an output
    # the markers are special tokens, which the detokenizer drops unless told to keep them (vLLM does the same)
    keeps_special_tokens: ClassVar[bool] = False

    @staticmethod
    def new_call_id() -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form

    def calls_start(self, text: str) -> int | None:
        """Where the tool-call markup begins in ``text``, None if it has not (yet) begun."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def undecided_suffix(self, text: str) -> int:
        """How many characters at the end of ``text`` (markup not begun) could still become a marker."""
        for size in range(min(len(text), max(len(m) for m in self.markers)), 0, -1):
            if any(m.startswith(text[-size:]) for m in self.markers):
                return size
        return 0

    @abstractmethod
    def calls(self, markup: str, finished: bool) -> list[ParsedCall]:
        """The calls complete in ``markup`` (which starts at ``calls_start``), in order; ``finished``: the output
        ended, so an unterminated last call counts if its JSON is whole."""

    @abstractmethod
    def partial_calls(self, markup: str) -> list[PartialCall]:
        """Every call begun in ``markup`` (which starts at ``calls_start``), in order, the last one possibly
        unfinished."""

    def parse(self, text: str, truncated: bool = False) -> ParsedOutput:
        """A finished output -> content and calls. ``truncated``: it was cut (``max_tokens``), so markup that began
        is an unfinished call: dropped (the complete calls before it kept), never returned as content."""
        start = self.calls_start(text)
        calls = [] if start is None else self.calls(text[start:], finished=not truncated)
        if start is not None and truncated:
            return ParsedOutput(text[:start] if text[:start].strip() else None, tuple(calls))
        if not calls:
            return ParsedOutput(text, ())
        return ParsedOutput(text[:start] if text[:start].strip() else None, tuple(calls))


def _call(obj: Any, arguments_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _decode_json(text: str, at: int) -> tuple[Any, int] | None:
    """(value, end) of the JSON value starting at ``text[at:]`` (leading spaces skipped), None if incomplete."""
    at = len(text) - len(text[at:].lstrip())
    try:
        return _DECODER.raw_decode(text, at)
    except json.JSONDecodeError:
        return None


def _partial_object(text: str, at: int, arguments_key: str) -> PartialCall | None:
    """The call object opening at ``text[at:]`` (spaces skipped) as far as it is written; None if none opens there."""
    i = _skip_spaces(text, at)
    if not text.startswith("{", i):
        return None
    name, arguments = None, ""
    i += 1
    while True:
        i = _skip_spaces(text, i)
        if text.startswith("}", i):
            return PartialCall(name, arguments, i + 1)
        if text.startswith(",", i):
            i += 1
            continue
        key = fixed_prefix(text, i)
        colon = _skip_spaces(text, key.end) if key.end is not None and text.startswith('"', i) else len(text)
        if not text.startswith(":", colon):
            return PartialCall(name, arguments, None)
        key_name, value_at = json.loads(text[i:key.end]), _skip_spaces(text, colon + 1)
        value = fixed_prefix(text, value_at)
        if key_name in (arguments_key, "arguments"):
            arguments = text[value_at:value.end]
        if value.end is None:
            return PartialCall(name, arguments, None)
        if key_name == "name":
            written = json.loads(text[value_at:value.end])
            name = written if isinstance(written, str) else None
        i = value.end


def _partial_sequence(text: str, at: int, arguments_key: str, separator: str) -> list[PartialCall]:
    """``_partial_object`` of each call in ``text[at:]``, the calls separated by ``separator`` ("": whitespace)."""
    calls = []
    while (call := _partial_object(text, at, arguments_key)) is not None:
        calls.append(call)
        rest = "" if call.end is None else text[call.end:].lstrip()
        if not rest.startswith(separator) or not rest:
            return calls
        at = len(text) - len(rest) + len(separator)
    return calls


def _skip_spaces(text: str, i: int) -> int:
    return len(text) - len(text[i:].lstrip()) if i < len(text) else i


def _json_calls(text: str, at: int, arguments_key: str, separator: str,
                require_arguments: bool = False) -> list[ParsedCall]:
    """Complete calls in ``text[at:]``: JSON objects separated by ``separator`` ("": whitespace alone), up to the
    first that is not (yet) a whole call; with ``require_arguments`` an object without ``arguments_key`` is none."""
    calls = []
    while True:
        decoded = _decode_json(text, at)
        if decoded is None or (require_arguments and not (isinstance(decoded[0], dict)
                                                          and arguments_key in decoded[0])):
            return calls
        call = _call(decoded[0], arguments_key)
        if call is None:
            return calls
        calls.append(call)
        rest = text[decoded[1]:].lstrip()
        if not rest.startswith(separator):
            return calls
        at = len(text) - len(rest) + len(separator)


class HermesToolParser(ToolParser):
    """Hermes blocks, and the bare form small Qwen2.5-Coder models write: an output that *begins* with
    ``{"name": ..., "arguments": {...}}`` (one or more such objects, no tags; Qwen2.5-Coder-0.5B-Instruct does this
    under its own tool template). Bare objects count only at the start of the output and only with an
    ``arguments`` key, so JSON later in a reply, or a JSON answer without ``arguments``, stays content."""

    name = "hermes"
    markers = ("<tool_call>",)
    _BARE = '{"name"'
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def calls_start(self, text: str) -> int | None:
        start = super().calls_start(text)
        stripped = text.lstrip()
        if start is None and stripped.startswith(self._BARE):
            return len(text) - len(stripped)
        return start

    def undecided_suffix(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped and self._BARE.startswith(stripped):  # the output so far could open a bare call
            return len(text)
        return super().undecided_suffix(text)

    def calls(self, markup: str, finished: bool) -> list[ParsedCall]:
        if markup.lstrip().startswith(self._BARE):
            return _json_calls(markup, 0, "arguments", "", require_arguments=True)
        return self._block_calls(markup, finished)

    def partial_calls(self, markup: str) -> list[PartialCall]:
        if markup.lstrip().startswith(self._BARE):
            return _partial_sequence(markup, 0, "arguments", "")
        calls = []
        for body in markup.split("<tool_call>")[1:]:
            call = _partial_object(body, 0, "arguments")
            if call is None:
                break
            calls.append(call)
        return calls

    def _block_calls(self, markup: str, finished: bool) -> list[ParsedCall]:
        bodies = [m.group(1) for m in self._BLOCK.finditer(markup)]
        tail = markup[markup.rfind("</tool_call>") + len("</tool_call>"):] if bodies else markup
        if finished and tail.lstrip().startswith("<tool_call>"):  # stopped (EOS) before the closing tag
            bodies.append(tail.lstrip()[len("<tool_call>"):])
        calls = []
        for body in bodies:
            try:
                call = _call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                break
            calls.append(call)
        return calls


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    keeps_special_tokens = True
    _ARGS = "[ARGS]"

    @staticmethod
    def new_call_id() -> str:
        return uuid.uuid4().hex[:9]  # Mistral's templates refuse ids that are not 9 alphanumerics (vLLM's too)

    def calls(self, markup: str, finished: bool) -> list[ParsedCall]:
        body = markup[len("[TOOL_CALLS]"):]
        if body.lstrip().startswith("["):
            return _json_calls(body, body.index("[") + 1, "arguments", ",")
        return self._named_calls(markup)

    def partial_calls(self, markup: str) -> list[PartialCall]:
        body = markup[len("[TOOL_CALLS]"):]
        if body.lstrip().startswith("["):
            return _partial_sequence(body, body.index("[") + 1, "arguments", ",")
        calls = []
        for piece in markup.split("[TOOL_CALLS]")[1:]:
            name, sep, arguments = piece.partition(self._ARGS)
            calls.append(PartialCall(name.strip() or None if sep else None, arguments))
        return calls

    def _named_calls(self, markup: str) -> list[ParsedCall]:
        calls = []
        for piece in markup.split("[TOOL_CALLS]")[1:]:
            name, sep, arguments = piece.partition(self._ARGS)
            decoded = _decode_json(arguments, 0) if sep else None
            if decoded is None or not isinstance(decoded[0], dict) or not name.strip():
                break
            calls.append(ParsedCall(name.strip(), json.dumps(decoded[0], ensure_ascii=False)))
        return calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    keeps_special_tokens = True

    def calls_start(self, text: str) -> int | None:
        """Only an output that *is* tool calls: the markup must open it (after spaces)."""
        stripped = text.lstrip()
        if stripped.startswith(self.markers):
            return len(text) - len(stripped)
        return None

    def undecided_suffix(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if any(m.startswith(stripped) for m in self.markers) else 0

    def calls(self, markup: str, finished: bool) -> list[ParsedCall]:
        return _json_calls(markup.removeprefix("<|python_tag|>"), 0, "parameters", ";")

    def partial_calls(self, markup: str) -> list[PartialCall]:
        return _partial_sequence(markup.removeprefix("<|python_tag|>"), 0, "parameters", ";")


class NamedToolOutput(ToolParser):
    """``tool_choice`` naming a function: the output is constrained to that function's arguments object."""

    name = "named"
    markers = ("",)

    def __init__(self, function_name: str):
        self.function_name = function_name

    def calls_start(self, text: str) -> int | None:
        return 0

    def calls(self, markup: str, finished: bool) -> list[ParsedCall]:
        decoded = _decode_json(markup, 0)
        if decoded is None or not isinstance(decoded[0], dict) or markup[decoded[1]:].strip():
            return []
        return [ParsedCall(self.function_name, json.dumps(decoded[0], ensure_ascii=False))]

    def partial_calls(self, markup: str) -> list[PartialCall]:
        return [PartialCall(self.function_name, markup)]


class RequiredToolsOutput(ToolParser):
    """``tool_choice: required``: the output is constrained to a JSON array of ``{"name", "parameters"}``
    (vLLM's form)."""

    name = "required"
    markers = ("",)

    def calls_start(self, text: str) -> int | None:
        return 0

    def calls(self, markup: str, finished: bool) -> list[ParsedCall]:
        stripped = markup.lstrip()
        if not stripped.startswith("["):
            return []
        return _json_calls(markup, len(markup) - len(stripped) + 1, "parameters", ",")

    def partial_calls(self, markup: str) -> list[PartialCall]:
        stripped = markup.lstrip()
        if not stripped.startswith("["):
            return []
        return _partial_sequence(markup, len(markup) - len(stripped) + 1, "parameters", ",")


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "qwen3": HermesToolParser, "mistral": MistralToolParser,
    "llama3_json": Llama3JsonToolParser,
}
# what each family's chat template writes when it renders a tool call (checked in this order)
_TEMPLATE_SIGNS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ('"parameters": ', "llama3_json"),
                   ("<|python_tag|>", "llama3_json"))


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


def parser_for_template(chat_template: str | dict[str, str] | None) -> ToolParser | None:
    """The parser of the family whose chat template this is (HF's named templates: all of them); None when it
    renders no tool calls."""
    text = " ".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template or ""
    for sign, name in _TEMPLATE_SIGNS:
        if sign in text:
            return tool_parser(name)
    return None

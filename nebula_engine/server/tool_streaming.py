"""A growing output text -> content deltas and tool-call deltas, for streams.

Content goes out as soon as it cannot be the start of tool-call markup (a possible marker prefix at the end is
held back). Once the markup begins, each call's arguments stream as the model writes them, as OpenAI and vLLM
stream them: a call's first delta carries its name, once the name is whole and its arguments object has begun;
the next ones carry pieces of the arguments text (``partial_json.fixed_prefix``: only what nothing later can
change), which add up to the whole call's ``arguments`` string. At the end of an output whose markup held no call
after all, the markup is sent as content, as the whole response would have it, unless the output was cut by
``max_tokens`` (a call not begun is dropped; one that began stays as far as it went, with ``finish_reason:
length``).
"""

from __future__ import annotations

from dataclasses import dataclass

from nebula_engine.server.partial_json import fixed_prefix
from nebula_engine.server.tool_parsers import ParsedCall, PartialCall, ToolParser


@dataclass(frozen=True)
class CallDelta:
    number: int  # which call of the output: 0, 1, ...
    name: str | None  # the call's name on its first delta, None on the others
    arguments: str  # the next piece of its arguments text
    complete: bool = False  # the call is whole: the pieces sent so far are all of its arguments


class ToolCallDeltas:
    def __init__(self, parser: ToolParser):
        self._parser = parser
        self._content_sent = 0
        self._arguments_sent: list[str] = []  # per call begun: its arguments text sent so far
        self._num_complete = 0

    @property
    def num_calls(self) -> int:
        """Calls begun so far."""
        return len(self._arguments_sent)

    def next(self, text: str, finished: bool, truncated: bool = False) -> tuple[str, list[CallDelta]]:
        """(content not sent yet, call deltas not sent yet) of the cumulative ``text``. ``truncated``: the output
        was cut (``max_tokens``): markup that began is an unfinished call, never content."""
        start = self._parser.calls_start(text)
        calls = [] if start is None else self._parser.calls(text[start:], finished and not truncated)
        if start is None or (finished and not truncated and not calls and not self._arguments_sent):
            end = len(text) if finished else len(text) - self._parser.undecided_suffix(text)
            return self._content_until(text, end), []
        content = self._content_until(text, start)
        return content, self._call_deltas(calls, self._parser.partial_calls(text[start:]))

    def _call_deltas(self, calls: list[ParsedCall], partial: list[PartialCall]) -> list[CallDelta]:
        deltas = []
        while self._num_complete < len(calls):
            number = self._num_complete
            deltas += self._delta(number, calls[number].name, self._rest(calls[number], partial, number), True)
            self._num_complete += 1
        number = len(calls)  # the call being written, if any: the ones after it have not begun
        if number < len(partial) and self._begun(partial[number], number):
            written = fixed_prefix(partial[number].arguments).text
            deltas += self._delta(number, partial[number].name, written[len(self._arguments_sent[number]):]
                                  if number < self.num_calls else written, False)
        return deltas

    def _begun(self, call: PartialCall, number: int) -> bool:
        return number < self.num_calls or (call.name is not None and call.arguments.lstrip().startswith("{"))

    def _rest(self, call: ParsedCall, partial: list[PartialCall], number: int) -> str:
        """What is left to send of a whole call's arguments. They continue what was sent, unless the object
        repeats a key (``json.loads`` keeps the last): then the stream keeps the text as written."""
        sent = self._arguments_sent[number] if number < self.num_calls else ""
        if call.arguments.startswith(sent) or number >= len(partial):
            return call.arguments[len(sent):]
        return fixed_prefix(partial[number].arguments).text[len(sent):]

    def _delta(self, number: int, name: str, arguments: str, complete: bool) -> list[CallDelta]:
        if number == self.num_calls:
            self._arguments_sent.append(arguments)
            return [CallDelta(number, name, arguments, complete)]
        self._arguments_sent[number] += arguments
        return [CallDelta(number, None, arguments, complete)] if arguments or complete else []

    def _content_until(self, text: str, end: int) -> str:
        delta = text[self._content_sent:end] if end > self._content_sent else ""
        self._content_sent = max(self._content_sent, end)
        return delta

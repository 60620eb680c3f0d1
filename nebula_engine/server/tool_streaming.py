"""A growing output text -> content deltas and newly complete tool calls, for streams.

Content goes out as soon as it cannot be the start of tool-call markup (a possible marker prefix at the end is
held back); once the markup begins, each call is sent when its JSON is complete. At the end of an output whose
markup held no call after all, the markup is sent as content, as the whole response would have it, unless the
output was cut by ``max_tokens`` (an unfinished call is dropped).
"""

from __future__ import annotations

from nebula_engine.server.tool_parsers import ParsedCall, ToolParser


class ToolCallDeltas:
    def __init__(self, parser: ToolParser):
        self._parser = parser
        self._content_sent = 0
        self.num_calls = 0

    def next(self, text: str, finished: bool, truncated: bool = False) -> tuple[str, list[ParsedCall]]:
        """(content not sent yet, calls not sent yet) of the cumulative ``text``. ``truncated``: the output was
        cut (``max_tokens``): markup that began is an unfinished call, never content."""
        start = self._parser.calls_start(text)
        calls = [] if start is None else self._parser.calls(text[start:], finished and not truncated)
        if start is None or (finished and not truncated and not calls and self.num_calls == 0):
            end = len(text) if finished else len(text) - self._parser.undecided_suffix(text)
            return self._content_until(text, end), []
        content = self._content_until(text, start)
        new, self.num_calls = calls[self.num_calls:], max(self.num_calls, len(calls))
        return content, new

    def _content_until(self, text: str, end: int) -> str:
        delta = text[self._content_sent:end] if end > self._content_sent else ""
        self._content_sent = max(self._content_sent, end)
        return delta

"""A one-line progress report for a replay: requests done / total, elapsed and estimated time left.

On a terminal the line is redrawn in place; elsewhere (a log file, CI) a line is printed at each quarter.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None, clock=time.monotonic):
        self.label, self.total = label, total
        self.stream = stream or sys.stderr
        self.clock = clock
        self.started = clock()
        self.done = 0
        self.failed = 0
        self._interactive = self.stream.isatty()
        self._next_quarter = 1

    def line(self) -> str:
        elapsed = self.clock() - self.started
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        eta_text = f"{eta:.0f} s" if self.done else "?"
        failed = f", {self.failed} failed" if self.failed else ""
        return f"  {self.label:<10} {self.done}/{self.total} requests done{failed}, {elapsed:.0f} s elapsed, " \
               f"ETA {eta_text}"

    def advance(self, ok: bool = True) -> None:
        self.done += 1
        self.failed += not ok
        if self._interactive:
            self.stream.write("\r" + self.line() + "\x1b[K")
            self.stream.flush()
        elif self.done * 4 >= self._next_quarter * self.total:
            while self.done * 4 >= self._next_quarter * self.total:
                self._next_quarter += 1
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def finish(self, note: str = "") -> None:
        elapsed = self.clock() - self.started
        text = f"  {self.label:<10} {self.done}/{self.total} requests in {elapsed:.0f} s{note}"
        self.stream.write(("\r" + text + "\x1b[K\n") if self._interactive else text + "\n")
        self.stream.flush()

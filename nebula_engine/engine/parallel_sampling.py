"""``n > 1``: one request fanned out to n independent sequences, their outputs gathered back into one.

As vLLM's parallel sampling: completion ``i`` runs as its own sequence ``f"{i}_{request_id}"`` with ``n=1`` and,
when seeded, ``seed + i``; the request's ``RequestOutput`` carries every completion produced so far, in index
order, and is finished once all n are.
"""

from __future__ import annotations

from dataclasses import replace

from nebula_engine.engine.outputs import RequestOutput


def child_request_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


class ParentRequest:
    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self.child_ids = [child_request_id(i, request_id) for i in range(n)]
        self._latest: dict[int, RequestOutput] = {}  # child index -> its newest output
        self.error: str | None = None

    def index_of(self, child_id: str) -> int:
        return self.child_ids.index(child_id)

    def update(self, child_id: str, output: RequestOutput) -> None:
        self._latest[self.index_of(child_id)] = output
        if output.error is not None and self.error is None:
            self.error = output.error

    def unfinished_child_ids(self) -> list[str]:
        return [c for i, c in enumerate(self.child_ids) if i not in self._latest or not self._latest[i].finished]

    @property
    def finished(self) -> bool:
        return self.error is not None or not self.unfinished_child_ids()

    def output(self) -> RequestOutput:
        """The request so far: the newest completion of each child that has produced one, in index order."""
        indices = sorted(self._latest)
        first = self._latest[indices[0]]
        completions = [replace(self._latest[i].outputs[0], index=i) for i in indices]
        return replace(first, request_id=self.request_id, outputs=completions, finished=self.finished,
                       error=self.error)

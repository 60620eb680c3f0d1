"""Hand-built requests for the control-plane tests, and a clock the tests move by hand."""

from nebula_engine.workloads.request import Request, Segment, SegmentKind


def request(request_id: str, *segments: tuple[str, str, int]) -> Request:
    """``segments``: (kind letter P=prefix R=regular I=pic, content id, tokens)."""
    kinds = {"P": SegmentKind.PREFIX, "R": SegmentKind.REGULAR, "I": SegmentKind.PIC}
    return Request(request_id, 0.0, request_id,
                   tuple(Segment(kinds[k], cid, n) for k, cid, n in segments))


def rag_requests(count: int, documents: int = 40, seed: int = 0) -> list[Request]:
    """A RAG-like stream: one of two system prompts, four documents out of a small pool, a query."""
    import random
    rng = random.Random(seed)
    out = []
    for i in range(count):
        docs = [("I", f"doc{d}", 100 + 7 * d) for d in rng.sample(range(documents), 4)]
        out.append(request(f"r{i}", ("P", f"sys{i % 2}", 200), *docs, ("R", f"q{i}", 20)))
    return out


class Clock:
    """A clock that stands still until a test sets ``now``."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

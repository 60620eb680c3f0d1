"""What one request does with its KV beyond what an ordinary request does, decided once when it is submitted.

The engine's own requests and a cluster's share one submit path; a cluster steers a request's KV only through
this plan:

- ``hold``: the prompt's pages stay allocated after the request finishes, until ``release_held`` (the prefill side
  of a prefill -> decode hand-off: the decode peer reads them first);
- ``gate``: queued now, scheduled once the gate opens (a combine whose remote KV is still arriving, ``KVGate``);
- ``prefill_only``: a plain prompt whose K/V is computed into the prefix cache and that finishes without a token,
  computing no logits (a peer prefilling a prompt's lead for another).
"""

from __future__ import annotations

from dataclasses import dataclass

from nebula_engine.engine.kv_gate import KVGate


@dataclass(frozen=True)
class KVPlan:
    hold: bool = False
    gate: KVGate | None = None
    prefill_only: bool = False

    def __post_init__(self) -> None:
        if self.prefill_only and self.hold:
            raise ValueError("a prefill_only request finishes without a token: there is nothing to hand off, so its "
                             "pages cannot be held")

    @property
    def waits_for_kv(self) -> bool:
        """Its gate is still shut: the scheduler passes it, and it keeps its place in the queue."""
        return self.gate is not None and not self.gate.is_open


ORDINARY = KVPlan()

"""The planner's fixed transfer costs as the running cluster measures them.

A profile gives two fixed costs in seconds: a read's latency (the link's ``latency_s``: on a local cluster the pin
round trip and the insert, paid once per source) and a scatter's dispatch (``ClusterProfile.dispatch_s``: how long
a cold segment prefilled by another worker waits there beyond its prefill and the read). Both were measured once,
at one load. Under a heavier load a scatter waits longer behind the helper's own work, and a plan that scattered
because dispatch was cheap then costs more than it saves. ``ObservedTransferCosts`` keeps the median of the last
``window`` observations of each, as the homes report them (``wire.TransferTime``), and the profile's value until
then, so the planner charges what transfers take now. One estimate serves every link: a local cluster has one kind.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import replace

from nebula_engine.cluster.control.config import ClusterProfile

# observations each median covers: about 30 s of the default compare's segment reads (48 requests in 48 s moved
# 100-250 segments per run); a window that short follows load as it changes within a run
WINDOW = 32


class ObservedTransferCosts:
    def __init__(self, profile: ClusterProfile, window: int = WINDOW):
        """Starts from ``profile``'s values, which count as one observation each until the window has moved on."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.profile = profile
        self._reads = deque([profile.intra_node.latency_s], maxlen=window)
        self._dispatches = deque([profile.dispatch_s], maxlen=window)

    @property
    def read_latency_s(self) -> float:
        return statistics.median(self._reads)

    @property
    def dispatch_s(self) -> float:
        return statistics.median(self._dispatches)

    def observe_read(self, seconds: float) -> None:
        """A segment already cached on its holder took ``seconds`` from the home's pin to its store."""
        self._reads.append(max(0.0, seconds))

    def observe_scatter(self, seconds: float, num_tokens: int) -> None:
        """A cold segment of ``num_tokens`` scattered to another worker took ``seconds`` from the home's pin to its
        store: what its predicted prefill and the read do not explain is dispatch (as ``dispatch_s`` was measured)."""
        prefill_s = self.profile.prefill.compute_seconds(num_tokens, 0.0)
        self._dispatches.append(max(0.0, seconds - prefill_s - self.read_latency_s))

    def current_profile(self) -> ClusterProfile:
        """The profile with the observed read latency on every link and the observed dispatch."""
        latency = self.read_latency_s
        return replace(self.profile, intra_node=replace(self.profile.intra_node, latency_s=latency),
                       inter_node=replace(self.profile.inter_node, latency_s=latency), dispatch_s=self.dispatch_s)

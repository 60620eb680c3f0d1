"""Arrival rates relative to what the simulated cluster can prefill (point 7 of the reproduction).

The paper replays each trace at a grid of rates (Fig. 11) on its own hardware and says nothing of their
load; its prefix-caching baseline queues at the top of every grid (P50 TTFT 2.7-76 s against Nebula's
0.18-0.79 s), i.e. it runs at or past saturation there. A simulated cluster with other per-token costs
would sit elsewhere on that curve at the same rates, so rates are expressed as a load relative to the
prefix-caching baseline's prefill capacity in the simulated cluster:

    capacity = workers / mean over requests of prefill.seconds(tokens an ideal prefix cache misses)

(the ideal cache is the reuse analysis' infinite one, ``workloads.analysis``), and ``load = qps / capacity``.
"""

from __future__ import annotations

from typing import Sequence

from nebula_engine.cluster.control.config import ClusterProfile
from nebula_engine.workloads.analysis import request_hits
from nebula_engine.workloads.request import Request


def pc_capacity_rps(requests: Sequence[Request], profile: ClusterProfile, num_workers: int) -> float:
    """Requests per second ``num_workers`` can prefill when prefix caching alone saves work."""
    if not requests:
        raise ValueError("no requests to measure a capacity on")
    seconds = [profile.prefill.seconds(r.num_tokens - pc, pc) for r, (pc, _) in zip(requests, request_hits(requests))]
    mean = sum(seconds) / len(seconds)
    return num_workers / mean if mean > 0 else float("inf")


def rate_grid(top_load: float, paper_grid: Sequence[float], capacity_rps: float) -> list[float]:
    """The paper's grid rescaled so its top rate offers ``top_load`` x the capacity, spacing kept."""
    top = max(paper_grid)
    return [capacity_rps * top_load * q / top for q in paper_grid]

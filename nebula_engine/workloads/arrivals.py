"""Arrival times for traces that log none: sessions start as a seeded Poisson process."""

from __future__ import annotations

import numpy as np


def session_start_times(num_sessions: int, mean_gap_s: float, seed: int) -> list[float]:
    gaps = np.random.default_rng(seed).exponential(mean_gap_s, size=num_sessions)
    return np.cumsum(gaps).tolist()

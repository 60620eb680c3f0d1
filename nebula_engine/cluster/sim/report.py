"""What a simulation run reports, and the arithmetic behind each number."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def coefficient_of_variation(values: list[float]) -> float:
    """Population CV (std / mean); 0 when the mean is 0."""
    mean = sum(values) / len(values) if values else 0.0
    if mean == 0:
        return 0.0
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / mean


@dataclass
class Counters:
    """Token and byte counters, accumulated over the measured requests only."""

    input_tokens: int = 0
    hit_tokens: int = 0
    host_hit_tokens: int = 0  # hits read back from a worker's host tier
    invalid_hit_tokens: int = 0
    repeated_tokens: int = 0
    transferred_bytes: int = 0
    handoff_bytes: int = 0
    computed_tokens: list[float] = field(default_factory=list)  # per prefill worker


@dataclass(frozen=True)
class SimulationReport:
    policy: str
    view: str
    cache: str
    scheduler: str
    qps: float
    num_requests: int
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    cache_hit_ratio: float  # token-weighted
    host_hit_tokens: int
    invalid_hit_tokens: int
    repeated_tokens: int
    transferred_bytes: int  # KV moved between prefill workers
    handoff_bytes: int  # KV handed to the decode worker (the paper's "NIXL TX payload" counts both)
    compute_cv: float  # population CV of cumulative prefill tokens across prefill workers
    ttft_slo_s: float
    goodput_rps: float  # requests meeting the SLO / (last completion - first arrival)
    pc_share_history: tuple[float, ...]
    ttfts_s: tuple[float, ...]

    @classmethod
    def build(cls, settings: dict, ttfts: list[float], counters: Counters, span_s: float,
              slo_s: float, pc_share_history: list[float]) -> "SimulationReport":
        good = sum(1 for t in ttfts if t <= slo_s)
        inputs = counters.input_tokens
        return cls(**settings, num_requests=len(ttfts),
                   ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95),
                   ttft_p99_s=percentile(ttfts, 99),
                   ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else math.nan,
                   cache_hit_ratio=counters.hit_tokens / inputs if inputs else 0.0,
                   host_hit_tokens=counters.host_hit_tokens,
                   invalid_hit_tokens=counters.invalid_hit_tokens, repeated_tokens=counters.repeated_tokens,
                   transferred_bytes=counters.transferred_bytes, handoff_bytes=counters.handoff_bytes,
                   compute_cv=coefficient_of_variation(counters.computed_tokens),
                   ttft_slo_s=slo_s, goodput_rps=good / span_s if span_s > 0 else 0.0,
                   pc_share_history=tuple(pc_share_history), ttfts_s=tuple(ttfts))

    def summary(self) -> dict:
        """Everything but the per-request TTFTs (for JSON output and tables)."""
        data = asdict(self)
        data.pop("ttfts_s")
        data["pc_share_final"] = self.pc_share_history[-1] if self.pc_share_history else None
        data.pop("pc_share_history")
        return data

    def format(self) -> str:
        gib = self.transferred_bytes / 2**30
        return "\n".join([
            f"policy={self.policy} view={self.view} cache={self.cache} scheduler={self.scheduler} "
            f"qps={self.qps:g} requests={self.num_requests}",
            f"TTFT  p50 {self.ttft_p50_s:.3f} s   p95 {self.ttft_p95_s:.3f} s   p99 {self.ttft_p99_s:.3f} s",
            f"CHR {100 * self.cache_hit_ratio:.2f} %   invalid-hit tokens {self.invalid_hit_tokens}   "
            f"repeated tokens {self.repeated_tokens}",
            f"transferred {gib:.3f} GiB   compute CV {self.compute_cv:.3f}   "
            f"goodput {self.goodput_rps:.2f} req/s (TTFT <= {self.ttft_slo_s:g} s)",
        ])

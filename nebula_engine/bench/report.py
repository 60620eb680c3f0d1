"""What a replay reports, and where: the summary arithmetic, ``bench_<label>.json`` and a TTFT CDF plot.

Definitions: TTFT percentiles (linear interpolation) over completed requests; CHR = sum of the
server's ``cached_tokens`` / sum of prompt tokens over completed requests (a server that reports no
cached tokens counts as 0 hits, and ``requests_without_usage`` says how many); goodput = completed
requests with TTFT <= the SLO per second of replay (start to last completion).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np

from nebula_engine.bench.replay import ReplayResult
from nebula_engine.extras import require_extra

PERCENTILES = (50, 95, 99)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; nan for no values."""
    return float(np.percentile(values, q)) if values else math.nan


def summarize(result: ReplayResult, ttft_slo_s: float = 1.0) -> dict:
    completed = [r for r in result.records if r.ok]
    ttfts = [r.ttft_s for r in completed]
    latencies = [r.latency_s for r in completed]
    prompt_tokens = sum(r.prompt_tokens for r in completed)
    cached_tokens = sum(r.cached_tokens or 0 for r in completed)
    duration = result.duration_s
    errors = Counter(r.error for r in result.records if not r.ok)
    return {
        "num_requests": len(result.records),
        "completed": len(completed),
        "failed": len(result.records) - len(completed),
        "errors": dict(errors.most_common(5)),
        **{f"ttft_p{q}_s": percentile(ttfts, q) for q in PERCENTILES},
        "ttft_mean_s": float(np.mean(ttfts)) if ttfts else math.nan,
        **{f"latency_p{q}_s": percentile(latencies, q) for q in PERCENTILES},
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "cache_hit_ratio": cached_tokens / prompt_tokens if prompt_tokens else math.nan,
        "requests_without_usage": sum(r.cached_tokens is None for r in completed),
        "ttft_slo_s": ttft_slo_s,
        "goodput_rps": sum(t <= ttft_slo_s for t in ttfts) / duration if duration > 0 else math.nan,
        "throughput_rps": len(completed) / duration if duration > 0 else math.nan,
        "offered_qps": result.qps,
        "duration_s": duration,
        "prompt_scale": result.prompt_scale,
    }


def format_summary(summary: dict) -> str:
    def seconds(key: str) -> str:
        return f"{summary[key] * 1e3:.1f} ms"

    return "\n".join([
        f"requests  {summary['completed']}/{summary['num_requests']} completed, {summary['failed']} failed",
        f"TTFT      p50 {seconds('ttft_p50_s')}  p95 {seconds('ttft_p95_s')}  p99 {seconds('ttft_p99_s')}",
        f"latency   p50 {seconds('latency_p50_s')}  p99 {seconds('latency_p99_s')}",
        f"CHR       {summary['cache_hit_ratio']:.3f} ({summary['cached_tokens']}/{summary['prompt_tokens']} tokens)",
        f"goodput   {summary['goodput_rps']:.2f} req/s with TTFT <= {summary['ttft_slo_s']} s "
        f"(offered {summary['offered_qps']} req/s)",
        *(f"error     {count} x {error}" for error, count in summary["errors"].items()),
    ])


def write_report(out_dir: Path, label: str, result: ReplayResult, summary: dict,
                 metadata: dict | None = None) -> tuple[Path, Path]:
    """Writes ``bench_<label>.json`` (summary, run settings, per-request records) and
    ``bench_<label>_ttft_cdf.png``; returns both paths. ``metadata`` adds to the run settings."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"bench_{label}.json", out_dir / f"bench_{label}_ttft_cdf.png"
    run = {**(metadata or {}), "url": result.url, "model": result.model, "qps": result.qps,
           "seed": result.seed, "vocab_size": result.vocab_size}
    document = {"label": label, "run": run, "summary": _nan_to_none(summary),
                "requests": [asdict(record) for record in result.records]}
    json_path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    plot_ttft_cdf(png_path, [r.ttft_s for r in result.records if r.ok], summary["ttft_slo_s"], label)
    return json_path, png_path


def _nan_to_none(summary: dict) -> dict:
    """Strict JSON has no NaN: an undefined number (no completed requests) is written as null."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in summary.items()}


def plot_ttft_cdf(path: Path, ttfts_s: list[float], slo_s: float, label: str) -> None:
    require_extra("matplotlib", "bench")
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend

    figure = Figure(figsize=(5, 3.5), layout="constrained")
    axes = figure.add_subplot()
    if ttfts_s:
        ordered = np.sort(ttfts_s)
        axes.step(ordered, np.arange(1, len(ordered) + 1) / len(ordered), where="post", label=label)
        axes.set_xlim(0, ordered[-1] * 1.05)
        if slo_s <= ordered[-1] * 1.05:  # an SLO far off the data would squash the curve
            axes.axvline(slo_s, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo_s:g} s")
        axes.legend(loc="lower right")
    else:
        axes.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=axes.transAxes)
    axes.set_title(f"TTFT CDF: {len(ttfts_s)} completed requests, SLO {slo_s:g} s", fontsize=9)
    axes.set_xlabel("TTFT (s)")
    axes.set_ylabel("fraction of requests")
    axes.set_ylim(0, 1.02)
    figure.savefig(path, dpi=120)

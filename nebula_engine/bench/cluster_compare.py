"""Compare cluster policies on this machine: for each of ``pc``, ``local-pic`` and ``nebula``, start a real local
cluster (one process per peer), replay the same workload slice at the same Poisson rate through its HTTP API,
and report TTFT percentiles and cache hit ratio, as ratios against ``pc``.

This is the repo's main job (``make run`` / ``nebula-engine compare``) and ``tools/bench_cluster.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import click

from nebula_engine.bench.replay import ReplayOptions, replay
from nebula_engine.bench.report import summarize
from nebula_engine.cluster.launcher import LocalCluster, local_spec
from nebula_engine.workloads.registry import load_workload

POLICIES = ("pc", "local-pic", "nebula")
# big enough that prefill compute, not HTTP and Python overhead, dominates TTFT on a CPU; still random weights
BENCH_MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                   intermediate_size=768, max_position_embeddings=8192)


def bench_model_dir() -> Path:
    """A random Qwen3 (``BENCH_MODEL``) with the real Qwen tokenizer, written under the user cache once."""
    from nebula_engine.engine.commands import cached_checkpoint

    return cached_checkpoint("bench-qwen3", "qwen3", seed=0, **BENCH_MODEL)


@dataclass(frozen=True)
class CompareOptions:
    trace: str = "ragpulse"
    num_requests: int = 48
    qps: float = 1.0
    prefill_workers: int = 2
    decode_workers: int = 1
    max_prompt_tokens: int = 1536
    max_tokens: int = 8
    seed: int = 0
    pic_backend: str = "auto"
    page_size: int = 16
    num_pages: int = 2048


def run_policy(model: str, policy: str, requests, options: CompareOptions, log_dir: Path) -> dict:
    spec = local_spec(options.prefill_workers, options.decode_workers, policy=policy)
    engine = {"page_size": options.page_size, "num_pages": options.num_pages,
              "pic_backend": None if options.pic_backend == "none" else options.pic_backend}
    with LocalCluster(model, spec, engine, log_dir=log_dir / policy) as cluster:
        url = cluster.urls[spec.peers[0].name]
        replay_options = ReplayOptions(seed=options.seed, max_tokens=options.max_tokens,
                                       max_prompt_tokens=options.max_prompt_tokens)
        result = asyncio.run(replay(url, requests, options.qps, replay_options))
        states = {name: cluster.state(name) for name in cluster.urls}
    summary = summarize(result)
    summary["policy"] = policy
    summary["transfer_bytes"] = sum(s.get("transfer_bytes", 0) for s in states.values())
    return summary


def compare(model: str, options: CompareOptions, out_dir: Path, data_dir: Path | None = None) -> list[dict]:
    requests = load_workload(options.trace, data_dir=data_dir, limit=options.num_requests,
                             seed=options.seed)[:options.num_requests]
    rows = []
    for policy in POLICIES:
        started = time.monotonic()
        rows.append(run_policy(model, policy, requests, options, out_dir / "logs"))
        click.echo(f"  {policy}: {len(requests)} requests in {time.monotonic() - started:.0f} s", err=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.json").write_text(json.dumps({"options": vars(options), "rows": rows}, indent=2,
                                                     default=str))
    return rows


def format_table(rows: list[dict]) -> str:
    base = next(r for r in rows if r["policy"] == "pc")

    def ratio(value: float, reference: float) -> str:
        return f"{value / reference:.2f}" if reference else "n/a"

    lines = [f"{'policy':<10} {'TTFT p50 s':>10} {'TTFT p99 s':>10} {'CHR':>6} {'p50/pc':>7} {'p99/pc':>7} "
             f"{'CHR/pc':>7} {'failed':>6} {'KV moved':>10}"]
    for row in rows:
        lines.append(f"{row['policy']:<10} {row['ttft_p50_s']:>10.3f} {row['ttft_p99_s']:>10.3f} "
                     f"{row['cache_hit_ratio']:>6.1%} {ratio(row['ttft_p50_s'], base['ttft_p50_s']):>7} "
                     f"{ratio(row['ttft_p99_s'], base['ttft_p99_s']):>7} {ratio(row['cache_hit_ratio'], base['cache_hit_ratio']):>7} "
                     f"{row['failed']:>6} {row['transfer_bytes'] / 2**20:>8.1f}MB")
    return "\n".join(lines)


@click.command("compare")
@click.option("--model", default=None, help="Checkpoint dir [default: a random 4-layer Qwen3 built on first use].")
@click.option("--trace", default="ragpulse", show_default=True, help="Workload (the RAGPulse slice ships inside).")
@click.option("--num-requests", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--qps", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True)
@click.option("--prefill-workers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--decode-workers", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--max-prompt-tokens", type=click.IntRange(min=16), default=1536, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--pic-backend", default="auto", show_default=True)
@click.option("--data", "data_dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench_results"),
              show_default=True)
def compare_command(model, data_dir, out_dir, **options) -> None:
    """Start a local cluster per policy (pc, local-pic, nebula), replay a workload slice, print the comparison."""
    opts = CompareOptions(**options)
    model = str(Path(model).resolve()) if model else str(bench_model_dir())
    click.echo(f"replaying {opts.num_requests} {opts.trace} requests at {opts.qps:g} req/s on "
               f"{opts.prefill_workers} prefill + {opts.decode_workers} decode peers, per policy ...", err=True)
    rows = compare(model, opts, out_dir, data_dir)
    click.echo(format_table(rows))
    click.echo(f"wrote {out_dir / 'compare.json'}")

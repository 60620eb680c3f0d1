"""Compare cluster policies on this machine: for each of ``pc``, ``local-pic`` and ``nebula`` (or those named with
``--policy``), start a real local cluster (one process per peer), replay the same workload slice at the same
Poisson rate through its HTTP API, and report TTFT percentiles and cache hit ratio, as ratios against ``pc``.

Every policy runs with the same settings (peers, threads, KV pool, slice, arrivals). Writes ``compare.json``
(options, the slice's reuse bound, one row per policy with its TTFTs) and ``compare.png`` (TTFT CDFs and hit
ratios) into the output folder, and each peer's log under ``logs/<policy>/``.

This is the repo's main job (``make run`` / ``nebula-engine compare``, whose command is ``cli/compare.py``) and
``tools/bench_cluster.py``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from nebula_engine.bench.host_cpu import cpu_jiffies, steal_share
from nebula_engine.bench.progress import Progress
from nebula_engine.bench.replay import ReplayOptions, as_sent, replay
from nebula_engine.bench.report import summarize
from nebula_engine.bench.results_page import ResultsPage, Table
from nebula_engine.cluster.runtime.launcher import LocalCluster, local_spec
from nebula_engine.cluster.runtime.spec import ClusterSpec, PeerSettings
from nebula_engine.workloads.analysis import reuse_stats
from nebula_engine.workloads.registry import load_workload
from nebula_engine.cluster.control.policy_names import POLICY_NAMES

# the random 4-layer Qwen3: smollm2 (real weights) on 4 one-thread peers of a 2-core machine saturates the cluster
# (all 48 requests completed, TTFT p50 55 s at 1 req/s), and make run must end in about 6 minutes
DEFAULT_MODEL = "bench-qwen3"
# big enough that prefill compute, not HTTP and Python overhead, dominates TTFT on a CPU; still random weights
BENCH_MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                   intermediate_size=768, max_position_embeddings=8192)


def bench_model_dir() -> Path:
    """A random Qwen3 (``BENCH_MODEL``) with the real Qwen tokenizer, written under the user cache once."""
    from nebula_engine.model.tiny import cached_checkpoint

    return cached_checkpoint("bench-qwen3", "qwen3", seed=0, **BENCH_MODEL)


@dataclass(frozen=True)
class CompareOptions:
    """The default regime (docs/results/main-job.md): the paper's argument needs per-peer KV below
    the slice's working set, load spread over several prefill peers, and prefill a real share of TTFT."""

    trace: str = "ragpulse"
    num_requests: int = 48  # 25 sessions, 144,039 prompt tokens; a working set of 78,459 distinct tokens
    # 48 s of arrivals per policy: with ~15-30 s of cluster start each, the three policies fit make run's 6 minutes
    # (0.5 req/s took 6.4 min); below saturation for the random Qwen3 (its peers use 37-50 of the 96 CPU seconds)
    qps: float = 1.0
    prefill_workers: int = 4  # the router spreads load over 4 peers: a session's documents can sit on any
    decode_workers: int = 0  # prefill peers decode too: one process less to load (8 output tokens only)
    # the bench model's context: the slice's longest prompt (4,591 tokens) is sent whole, so documents keep their
    # real length (~280 tokens). Shrunk to fit 1,024 tokens they would average 62 tokens, and EPIC's 16 recomputed
    # tokens per segment (26% of them) would cancel what PIC hits save
    max_prompt_tokens: int = 8192
    max_tokens: int = 8
    seed: int = 0
    pic_backend: str = "auto"
    page_size: int = 16
    # per peer: its KV pool (running requests + cached PC and PIC entries), 18,432 tokens: 23.5% of the working
    # set, 94% over the 4 peers: only cluster-wide reuse can reach most of it
    num_pages: int = 1152
    threads_per_peer: int | None = 1  # 4 peers on 2 cores: one torch thread each, no oversubscription
    # silence after which a peer counts as dead: on a crowded 2-core machine (load 14) smollm2 peers were measured
    # silent for over 3 s (the serving default) mid-prefill, and every request was re-run until it gave up
    peer_timeout_s: float = 30.0
    # five smollm2 peers loading at once on a crowded 2-core machine (load 14) took over 180 s to come up
    start_timeout_s: float = 900.0
    policies: tuple[str, ...] = POLICY_NAMES
    # what the planner charges once per remote source (ClusterSpec.remote_read_latency_s, measured there)
    remote_read_latency_s: float = ClusterSpec.remote_read_latency_s
    scatter_dispatch_s: float = ClusterSpec.scatter_dispatch_s  # and per cold segment scattered to another peer
    shared_cores: bool = ClusterSpec.shared_cores  # the planner knows the peers share this machine's cores
    # whether the planner then charges what reads and scatters take (off, as in the spec: see ClusterSpec)
    observe_transfer_costs: bool = ClusterSpec.observe_transfer_costs
    log_level: str = "warning"  # the peers' (debug: each combine's remote KV wait, each read's pin and store times)

    @property
    def kv_tokens_per_peer(self) -> int:
        return self.page_size * self.num_pages


def run_policy(model: str, policy: str, requests, options: CompareOptions, log_dir: Path) -> dict:
    spec = local_spec(options.prefill_workers, options.decode_workers, policy=policy,
                      remote_read_latency_s=options.remote_read_latency_s,
                      scatter_dispatch_s=options.scatter_dispatch_s, shared_cores=options.shared_cores,
                      observe_transfer_costs=options.observe_transfer_costs)
    engine = {"page_size": options.page_size, "num_pages": options.num_pages,
              "pic_backend": None if options.pic_backend == "none" else options.pic_backend}
    settings = PeerSettings(peer_timeout_s=options.peer_timeout_s, failover_timeout_s=2 * options.peer_timeout_s)
    cluster = LocalCluster(model, spec, engine, log_dir=log_dir / policy, settings=settings,
                           torch_threads=options.threads_per_peer, log_level=options.log_level)
    started = time.monotonic()
    click.echo(f"  {policy:<10} starting {len(spec.peers)} peers ...", err=True)
    cluster.start(options.start_timeout_s)
    try:
        click.echo(f"  {policy:<10} cluster up in {time.monotonic() - started:.0f} s; replaying", err=True)
        url = cluster.urls[spec.peers[0].name]
        replay_options = ReplayOptions(seed=options.seed, max_tokens=options.max_tokens,
                                       max_prompt_tokens=options.max_prompt_tokens)
        progress = Progress(policy, len(requests))
        cpu_before, jiffies_before = cluster.cpu_seconds(), cpu_jiffies()
        result = asyncio.run(replay(url, requests, options.qps, replay_options,
                                    on_done=lambda record: progress.advance(record.ok)))
        cpu_after, jiffies_after = cluster.cpu_seconds(), cpu_jiffies()
        states = {name: cluster.state(name) for name in cluster.urls}
    finally:
        cluster.stop()
    summary = summarize(result)
    first_error = next(iter(summary["errors"]), "")
    progress.finish(f", {summary['failed']} failed (e.g. {first_error[:160]})" if summary["failed"] else "")
    summary["policy"] = policy
    summary["transfer_bytes"] = sum(s.get("transfer_bytes", 0) for s in states.values())
    # PIC segment tokens the peers prefilled (cold segments, for their own requests or scattered to them)
    summary["segment_tokens_prefilled"] = sum(s.get("pic", {}).get("segment_tokens_prefilled", 0)
                                              for s in states.values())
    summary["ttfts_s"] = [r.ttft_s for r in result.records if r.ok]
    # CPU the peers used while the workload ran (None without /proc): what each policy costs the shared cores
    summary["peer_cpu_s"] = (sum(cpu_after.values()) - sum(cpu_before.values())
                             if cpu_after and cpu_after.keys() == cpu_before.keys() else None)
    summary["host_steal"] = steal_share(jiffies_before, jiffies_after)  # None off Linux
    return summary


def slice_bound(requests, max_prompt_tokens: int | None) -> dict:
    """The most any cache can hit on this slice as replayed (every segment seen before, anywhere: what
    ``nebula-engine analyze`` reports), and prefix caching alone."""
    stats = reuse_stats(as_sent(requests, max_prompt_tokens))
    return {"hit_ratio_bound": stats.pic / 100, "pc_hit_ratio_bound": stats.pc / 100}


def compare(model: str, options: CompareOptions, out_dir: Path, data_dir: Path | None = None) -> list[dict]:
    requests = load_workload(options.trace, data_dir=data_dir, limit=options.num_requests,
                             seed=options.seed)[:options.num_requests]
    bound = slice_bound(requests, options.max_prompt_tokens)
    rows = [run_policy(model, policy, requests, options, out_dir / "logs") for policy in options.policies]
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {"model": model, "options": {**asdict(options), "kv_tokens_per_peer": options.kv_tokens_per_peer},
                **bound, "rows": [_json_safe(row) for row in rows]}
    (out_dir / "compare.json").write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    plot_compare(out_dir / "compare.png", rows, bound["hit_ratio_bound"],
                 f"{len(requests)} {options.trace} requests at {options.qps:g} req/s, "
                 f"{options.prefill_workers} prefill + {options.decode_workers} decode peers")
    return rows


def _json_safe(row: dict) -> dict:
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


COLUMNS_EXPLAINED = (
    "TTFT p50/p99: time to first token, median and 99th percentile over completed requests, from the request "
    "leaving the client to its first streamed token.",
    "CHR: cache hit ratio, prompt tokens served from KV that existed before the request (prefix cache, or PIC "
    "segments held on the home peer or read from another peer) / all prompt tokens; segments prefilled for the "
    "request itself are no hits.",
    "x/pc: the policy's figure divided by pc's (below 1.00 = faster TTFT; above 1.00 = more hits).",
    "failed: requests without a complete answer.  KV moved: bytes peers read from each other over NIXL.",
    "peer CPU: CPU seconds all peers used (user + system, every thread) while the requests ran; the peers share "
    "this machine's cores, so work one policy adds delays every request.",
    "steal: share of this machine's CPU time its hypervisor gave to other guests while the requests ran; where it "
    "differs between policies, so did the conditions they ran in.",
)


def _cpu(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.1f}s"


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def format_table(rows: list[dict], bound: float | None = None) -> str:
    """Ratios against ``pc``, or against the first row when ``pc`` did not run."""
    base = next((r for r in rows if r["policy"] == "pc"), rows[0])

    def ratio(value: float, reference: float) -> str:
        return f"{value / reference:.2f}" if reference else "n/a"

    lines = [f"{'policy':<10} {'TTFT p50 s':>10} {'TTFT p99 s':>10} {'CHR':>6} {'p50/pc':>7} {'p99/pc':>7} "
             f"{'CHR/pc':>7} {'failed':>6} {'KV moved':>10} {'peer CPU':>9} {'steal':>6}"]
    for row in rows:
        lines.append(f"{row['policy']:<10} {row['ttft_p50_s']:>10.3f} {row['ttft_p99_s']:>10.3f} "
                     f"{row['cache_hit_ratio']:>6.1%} {ratio(row['ttft_p50_s'], base['ttft_p50_s']):>7} "
                     f"{ratio(row['ttft_p99_s'], base['ttft_p99_s']):>7} "
                     f"{ratio(row['cache_hit_ratio'], base['cache_hit_ratio']):>7} "
                     f"{row['failed']:>6} {row['transfer_bytes'] / 2**20:>8.1f}MB "
                     f"{_cpu(row.get('peer_cpu_s')):>9} {_share(row.get('host_steal')):>6}")
    lines += ["", *(f"  {line}" for line in COLUMNS_EXPLAINED)]
    if bound is not None:
        lines.append(f"  The slice's reuse bound (every segment seen before, with an unbounded cache): CHR {bound:.1%}.")
    return "\n".join(lines)


MAIN_JOB_ABOUT = (
    "The main job (`make run`): for each cluster policy, a real local cluster of engine processes on this machine "
    "replays the same workload slice through the HTTP API with the same Poisson arrivals. `pc` routes by prefix "
    "(no PIC), `local-pic` runs PIC on each worker behind that router, `nebula` plans cluster-wide PIC (the view, "
    "cache manager and planner of the paper). With the default random-weight model the figures measure the system "
    "(caching, transfers, scheduling), not answer quality.")


def main_job_page(document: dict, png: Path | None) -> ResultsPage:
    """``docs/results/main-job.md`` from what ``compare`` wrote to ``compare.json`` (and its plot)."""
    options, rows = document["options"], document["rows"]
    base = next((r for r in rows if r["policy"] == "pc"), rows[0])

    def ratio(row: dict, key: str) -> str:
        return f"{row[key] / base[key]:.2f}" if base[key] else "n/a"

    results = Table(
        ("policy", "TTFT p50 s", "TTFT p99 s", "CHR", f"p50 / {base['policy']}", f"p99 / {base['policy']}",
         "failed", "KV moved", "peer CPU", "steal"),
        tuple((r["policy"], f"{r['ttft_p50_s']:.3f}", f"{r['ttft_p99_s']:.3f}", f"{r['cache_hit_ratio']:.1%}",
               ratio(r, "ttft_p50_s"), ratio(r, "ttft_p99_s"), r["failed"], f"{r['transfer_bytes'] / 2**20:.1f} MB",
               _cpu(r.get("peer_cpu_s")), _share(r.get("host_steal"))) for r in rows))
    threads = options.get("threads_per_peer") or "torch's default"
    settings = Table(("setting", "value"), (
        ("model", Path(document["model"]).name),
        ("slice", f"the first {options['num_requests']} {options['trace']} requests, prompts up to "
                  f"{options['max_prompt_tokens']:,} tokens, {options['max_tokens']} output tokens each"),
        ("arrivals", f"Poisson at {options['qps']:g} req/s, seed {options['seed']}"),
        ("peers", f"{options['prefill_workers']} prefill + {options['decode_workers']} decode, {threads} torch "
                  f"thread(s) each"),
        ("KV per peer", f"{options['num_pages']:,} pages x {options['page_size']} = "
                        f"{options['num_pages'] * options['page_size']:,} tokens"),
        ("PIC backend", options["pic_backend"]),
        ("reuse bound of the slice", f"{document['hit_ratio_bound']:.1%} (prefix caching alone "
                                     f"{document['pc_hit_ratio_bound']:.1%})"),
    ), caption="Settings (every one is an option of `nebula-engine compare`):")
    return ResultsPage("main-job", "Main job: cluster policies on one machine", MAIN_JOB_ABOUT, (results, settings),
                       notes=COLUMNS_EXPLAINED, png=png)


def plot_compare(path: Path, rows: list[dict], bound: float | None, title: str) -> None:
    """TTFT CDF of each policy beside a bar of each policy's cache hit ratio."""
    import numpy as np
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend

    figure = Figure(figsize=(9, 3.6), layout="constrained")
    cdf, bars = figure.subplots(1, 2, width_ratios=(2, 1))
    for row in rows:
        ttfts = np.sort(row["ttfts_s"])
        if len(ttfts):
            cdf.step(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post",
                     label=f"{row['policy']} (p50 {row['ttft_p50_s']:.3f} s)")
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (s, log scale)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_ylim(0, 1.02)
    cdf.legend(loc="lower right", fontsize=8)
    cdf.set_title(title, fontsize=9)
    names = [row["policy"] for row in rows]
    ratios = [row["cache_hit_ratio"] * 100 for row in rows]
    bars.bar(names, ratios, color=[f"C{i}" for i in range(len(rows))])  # the CDF lines' colours
    for x, value in enumerate(ratios):
        bars.text(x, value, f"{value:.1f}%", ha="center", va="bottom", fontsize=8)
    if bound is not None:
        bars.axhline(bound * 100, color="black", linestyle="--", linewidth=1, label=f"slice bound {bound:.0%}")
        bars.legend(loc="lower right", fontsize=8)
    bars.set_ylabel("cache hit ratio (%)")
    bars.set_ylim(0, 100)
    bars.set_title("prompt tokens from existing KV", fontsize=9)
    figure.savefig(path, dpi=120)

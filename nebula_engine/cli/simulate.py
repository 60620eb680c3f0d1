"""`nebula-engine simulate`: replay a workload through the cluster simulator and print the report."""

from __future__ import annotations

import json
from dataclasses import replace

import click

from nebula_engine.cluster.control.config import ClusterConfig, ClusterProfile
from nebula_engine.cluster.sim.loads import pc_capacity_rps
from nebula_engine.cluster.control.policies import CACHES, POLICIES, VIEWS
from nebula_engine.cluster.control.schedulers import SCHEDULERS
from nebula_engine.cluster.sim.simulator import SimulationConfig, check_simulable, simulate as run_simulation

WORKLOAD_NAMES = ("ragpulse", "tau-bench", "chatdev", "swe-agent", "doc2dial", "quac")


def build_profile(options: dict) -> ClusterProfile:
    """The profile file with the command line's overrides applied on top; ValueError for one the simulator cannot
    model."""
    profile = ClusterProfile.load(options["profile"])
    check_simulable(profile)
    overrides = {field: options[option] for option, field in (("capacity", "cache_capacity_tokens"),
                                                              ("host_capacity", "host_capacity_tokens"))
                 if options[option] is not None}
    return replace(profile, **overrides)


def build_config(options: dict, qps: float) -> SimulationConfig:
    """CLI options -> a frozen SimulationConfig."""
    cluster = ClusterConfig(num_prefill_workers=options["workers"], profile=build_profile(options),
                            event_delay_s=options["event_delay"], seed=options["seed"])
    cluster = replace(cluster, view=replace(cluster.view, unconfirmed_ttl_s=options["ttl"]),
                      cache_manager=replace(cluster.cache_manager, update_window=options["update_window"]))
    return SimulationConfig(cluster=cluster, policy=options["policy"], view=options["view"],
                            cache=options["cache"], scheduler=options["scheduler"], qps=qps,
                            ttft_slo_s=options["slo"], warmup_requests=options["warmup"],
                            ttft_includes_handoff=options["first_token_at"] == "decode")


@click.command("simulate")
@click.option("--workload", type=click.Choice(WORKLOAD_NAMES), default="ragpulse", show_default=True)
@click.option("--data", "data_dir", type=click.Path(file_okay=False), default=None,
              help="Traces directory (default: $NEBULA_TRACES, ../shared/traces, or the bundled slice).")
@click.option("--qps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Poisson arrival rate [default: 8, unless --load is given].")
@click.option("--load", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Arrival rate as a multiple of the prefix-caching baseline's prefill capacity here "
                   "(cluster/sim/loads.py); instead of --qps.")
@click.option("--workers", type=click.IntRange(min=1), default=7, show_default=True,
              help="Prefill workers (one decode worker is added).")
@click.option("--policy", type=click.Choice(sorted(POLICIES)), default="nebula", show_default=True)
@click.option("--view", type=click.Choice(VIEWS), default=None,
              help="View synchronisation (default: nebula for --policy nebula, event for the baselines).")
@click.option("--cache", type=click.Choice(sorted(CACHES)), default=None,
              help="Workers' PC/PIC eviction (default: self-tuning for nebula, unified-lru for the baselines).")
@click.option("--scheduler", type=click.Choice(sorted(SCHEDULERS)), default="greedy", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--limit", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Requests to replay (trace order).")
@click.option("--warmup", type=click.IntRange(min=0), default=0, show_default=True,
              help="Leading requests excluded from the metrics.")
@click.option("--profile", default="default", show_default=True,
              help="Profile JSON path (nebula-engine profile writes one), or the name of a shipped profile.")
@click.option("--capacity", type=click.IntRange(min=1), default=None,
              help="Override the device cache per worker, in tokens.")
@click.option("--host-capacity", type=click.IntRange(min=0), default=None,
              help="Override the host tier per worker, in tokens (0: none).")
@click.option("--ttl", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds an unconfirmed cache location lives.")
@click.option("--event-delay", type=click.FloatRange(min=0), default=0.005, show_default=True)
@click.option("--update-window", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--first-token-at", type=click.Choice(["decode", "prefill"]), default="decode", show_default=True,
              help="TTFT ends after the KV hand-off to the decode worker (SGLang PD, the paper) or when the "
                   "prefill worker produces it (this engine's cluster).")
@click.option("--slo", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="TTFT SLO in seconds for goodput.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def simulate(workload: str, data_dir: str | None, limit: int, as_json: bool, qps: float | None,
             load: float | None, **options) -> None:
    """Simulate a prefill cluster replaying WORKLOAD with Poisson arrivals at --qps (or --load)."""
    from nebula_engine.workloads import load_workload, reuse_stats

    if qps is not None and load is not None:
        raise click.UsageError("give --qps or --load, not both")
    try:
        profile = build_profile(options)
    except (FileNotFoundError, ValueError) as error:
        raise click.BadParameter(str(error), param_hint="--profile") from error
    try:
        requests = load_workload(workload, data_dir=data_dir, limit=limit, seed=options["seed"])[:limit]
    except FileNotFoundError as error:
        raise click.UsageError(str(error)) from error
    if not requests:
        raise click.ClickException(f"no {workload} requests found")
    capacity = pc_capacity_rps(requests, profile, options["workers"])
    rate = qps if qps is not None else (8.0 if load is None else load * capacity)
    report = run_simulation(build_config(options, rate), requests)
    bound = reuse_stats(requests)
    if as_json:
        click.echo(json.dumps({"workload": workload, "profile": profile.name, "load": rate / capacity,
                               "pc_capacity_rps": capacity, "hit_ratio_bound": bound.pic / 100,
                               "pc_hit_ratio_bound": bound.pc / 100, **report.summary()}, indent=2))
    else:
        click.echo(f"workload={workload} profile={profile.name} load={rate / capacity:.2f} x the prefix-caching "
                   f"capacity ({capacity:.2f} req/s)")
        click.echo(report.format())
        click.echo(f"CHR bound (reuse analysis) {bound.pic:.2f} %")

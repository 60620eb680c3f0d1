"""`nebula-engine simulate`: replay a workload through the cluster simulator and print the report."""

from __future__ import annotations

import json
from dataclasses import replace

import click

from nebula_engine.cluster.config import ClusterConfig, ClusterProfile
from nebula_engine.cluster.policies import CACHES, POLICIES, VIEWS
from nebula_engine.cluster.schedulers import SCHEDULERS
from nebula_engine.cluster.sim import SimulationConfig, simulate as run_simulation

WORKLOAD_NAMES = ("ragpulse", "tau-bench", "chatdev", "swe-agent", "doc2dial", "quac")


def build_config(options: dict) -> SimulationConfig:
    """CLI options -> a frozen SimulationConfig (profile overrides applied on top of the file)."""
    profile = ClusterProfile.load(options["profile"])
    if options["capacity"] is not None:
        profile = replace(profile, cache_capacity_tokens=options["capacity"])
    cluster = ClusterConfig(num_prefill_workers=options["workers"], profile=profile,
                            event_delay_s=options["event_delay"], seed=options["seed"])
    cluster = replace(cluster, view=replace(cluster.view, unconfirmed_ttl_s=options["ttl"]),
                      cache_manager=replace(cluster.cache_manager, update_window=options["update_window"]))
    return SimulationConfig(cluster=cluster, policy=options["policy"], view=options["view"],
                            cache=options["cache"], scheduler=options["scheduler"], qps=options["qps"],
                            ttft_slo_s=options["slo"], warmup_requests=options["warmup"])


@click.command("simulate")
@click.option("--workload", type=click.Choice(WORKLOAD_NAMES), default="ragpulse", show_default=True)
@click.option("--data", "data_dir", type=click.Path(file_okay=False), default=None,
              help="Traces directory (default: $NEBULA_TRACES, ../shared/traces, or the bundled slice).")
@click.option("--qps", type=click.FloatRange(min=0, min_open=True), default=8.0, show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=7, show_default=True,
              help="Prefill workers (one decode worker is added).")
@click.option("--policy", type=click.Choice(sorted(POLICIES)), default="nebula", show_default=True)
@click.option("--view", type=click.Choice(VIEWS), default=None,
              help="View synchronisation (default: nebula for --policy nebula, event for the baselines).")
@click.option("--cache", type=click.Choice(sorted(CACHES)), default="self-tuning", show_default=True)
@click.option("--scheduler", type=click.Choice(sorted(SCHEDULERS)), default="greedy", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--limit", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Requests to replay (trace order).")
@click.option("--warmup", type=click.IntRange(min=0), default=0, show_default=True,
              help="Leading requests excluded from the metrics.")
@click.option("--profile", default="default", show_default=True,
              help="Profile JSON path, or the name of a shipped profile.")
@click.option("--capacity", type=click.IntRange(min=1), default=None,
              help="Override cache capacity per worker, in tokens.")
@click.option("--ttl", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds an unconfirmed cache location lives.")
@click.option("--event-delay", type=click.FloatRange(min=0), default=0.005, show_default=True)
@click.option("--update-window", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--slo", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="TTFT SLO in seconds for goodput.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def simulate(workload: str, data_dir: str | None, limit: int, as_json: bool, **options) -> None:
    """Simulate a prefill cluster replaying WORKLOAD with Poisson arrivals at --qps."""
    from nebula_engine.workloads import load_workload

    try:
        profile_config = build_config(options)
    except FileNotFoundError as error:
        raise click.BadParameter(str(error), param_hint="--profile") from error
    try:
        requests = load_workload(workload, data_dir=data_dir, limit=limit, seed=options["seed"])
    except FileNotFoundError as error:
        raise click.UsageError(str(error)) from error
    report = run_simulation(profile_config, requests[:limit])
    if as_json:
        click.echo(json.dumps({"workload": workload, **report.summary()}, indent=2))
    else:
        click.echo(f"workload={workload}")
        click.echo(report.format())

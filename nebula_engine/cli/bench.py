"""`nebula-engine bench`: replay a workload trace against a server and report TTFT, CHR and goodput."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from nebula_engine.workloads.registry import WORKLOADS, WorkloadDataMissing, load_workload

TRACE_ALIASES = {"swe": "swe-agent"}


@click.command("bench")
@click.option("--url", required=True, help="Server base URL, e.g. http://127.0.0.1:8000.")
@click.option("--trace", type=click.Choice([*WORKLOADS, *TRACE_ALIASES]), required=True,
              help="Workload to replay (swe = swe-agent).")
@click.option("--qps", type=click.FloatRange(min=0, min_open=True), required=True,
              help="Mean arrival rate of the Poisson process.")
@click.option("--num-requests", type=click.IntRange(min=1), default=200, show_default=True,
              help="Replay the first N requests, in trace order.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of arrivals and trace generators.")
@click.option("--data", "data_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Traces directory [default: $NEBULA_TRACES, else ../shared/traces].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("bench_results"), show_default=True)
@click.option("--label", default=None, help="Names the outputs bench_<label>.* [default: <trace>_qps<Q>].")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Output tokens per request [default: the trace's own].")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=None,
              help="Shrink prompts (one scale for the run, segment structure kept) to fit a small model.")
@click.option("--vocab-size", type=click.IntRange(min=101), default=None,
              help="Vocabulary for synthesized token ids [default: /v1/models vocab_size, else 32000].")
@click.option("--model", default=None, help="Model name to request [default: the first of /v1/models].")
@click.option("--ttft-slo", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="TTFT SLO in seconds for goodput.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0,
              show_default=True, help="Seconds before a request counts as failed.")
def bench(url: str, trace: str, qps: float, num_requests: int, seed: int, data_dir: Path | None,
          out_dir: Path, label: str | None, ttft_slo: float, **options) -> None:
    """Replay TRACE against the OpenAI-compatible server at --url with Poisson arrivals at --qps."""
    from nebula_engine.bench.replay import BenchError, ReplayOptions, replay
    from nebula_engine.bench.report import format_summary, summarize, write_report

    workload = TRACE_ALIASES.get(trace, trace)
    try:
        requests = load_workload(workload, data_dir=data_dir, limit=num_requests, seed=seed)[:num_requests]
    except WorkloadDataMissing as error:
        raise click.UsageError(f"{error}; pass --data DIR or set $NEBULA_TRACES") from error
    if not requests:
        raise click.ClickException(f"no {workload} requests found")
    replay_options = ReplayOptions(seed=seed, max_tokens=options["max_tokens"],
                                   max_prompt_tokens=options["max_prompt_tokens"],
                                   vocab_size=options["vocab_size"], model=options["model"],
                                   request_timeout_s=options["request_timeout"])
    try:
        result = asyncio.run(replay(url, requests, qps, replay_options))
    except BenchError as error:
        raise click.ClickException(str(error)) from error
    summary = summarize(result, ttft_slo_s=ttft_slo)
    label = label or f"{workload}_qps{qps:g}"
    metadata = {"trace": workload, "num_requests": len(requests), "ttft_slo_s": ttft_slo, "options": options}
    json_path, png_path = write_report(out_dir, label, result, summary, metadata)
    click.echo(f"{workload}: {len(requests)} requests at {qps:g} req/s against {url} ({result.model})")
    click.echo(format_summary(summary))
    click.echo(f"wrote {json_path} and {png_path}")


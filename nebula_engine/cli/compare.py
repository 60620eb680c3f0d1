"""``nebula-engine compare``: the policies side by side, each on a real local cluster (``bench/cluster_compare.py``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from nebula_engine.bench import cluster_compare
from nebula_engine.bench.cluster_compare import DEFAULT_MODEL, CompareOptions, format_table, main_job_page
from nebula_engine.bench.results_page import DOCS_RESULTS, write_page
from nebula_engine.cluster.control.policy_names import POLICY_NAMES


@click.command("compare")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="Model of every peer: a short name, a checkpoint dir or GGUF file; 'bench-qwen3' = a random "
                   "4-layer Qwen3 built on first use.")
@click.option("--download", is_flag=True, help="Fetch a catalog model that is not downloaded yet.")
@click.option("--trace", default=CompareOptions.trace, show_default=True,
              help="Workload (the RAGPulse slice ships inside; others read --data).")
@click.option("--num-requests", type=click.IntRange(min=1), default=CompareOptions.num_requests, show_default=True)
@click.option("--qps", type=click.FloatRange(min=0, min_open=True), default=CompareOptions.qps, show_default=True,
              help="Poisson arrival rate.")
@click.option("--prefill-workers", type=click.IntRange(min=1), default=CompareOptions.prefill_workers,
              show_default=True)
@click.option("--decode-workers", type=click.IntRange(min=0), default=CompareOptions.decode_workers,
              show_default=True)
@click.option("--threads-per-peer", type=click.IntRange(min=1), default=CompareOptions.threads_per_peer,
              show_default=True, help="torch threads of each peer [default: torch's own, one per core].")
@click.option("--num-pages", type=click.IntRange(min=16), default=CompareOptions.num_pages, show_default=True,
              help="KV pages of each peer (x --page-size tokens): running requests plus its cache.")
@click.option("--page-size", type=click.IntRange(min=1), default=CompareOptions.page_size, show_default=True)
@click.option("--max-prompt-tokens", type=click.IntRange(min=16), default=CompareOptions.max_prompt_tokens,
              show_default=True, help="Prompts shrink by one factor for the run so the longest fits.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=CompareOptions.max_tokens, show_default=True)
@click.option("--pic-backend", default=CompareOptions.pic_backend, show_default=True)
@click.option("--seed", type=int, default=CompareOptions.seed, show_default=True)
@click.option("--policy", "policies", type=click.Choice(POLICY_NAMES), multiple=True,
              help="Run only this policy (repeatable; default: all three, in the order pc, local-pic, nebula).")
@click.option("--remote-read-latency", "remote_read_latency_s", type=click.FloatRange(min=0),
              default=CompareOptions.remote_read_latency_s, show_default=True,
              help="Seconds the planner charges once per peer it reads KV from (the cluster spec's "
                   "remote_read_latency_s; 0: every read the data plane offers is planned).")
@click.option("--scatter-dispatch", "scatter_dispatch_s", type=click.FloatRange(min=0),
              default=CompareOptions.scatter_dispatch_s, show_default=True,
              help="Seconds the planner charges a cold segment it scatters to another peer, beyond its prefill and "
                   "the read (the cluster spec's scatter_dispatch_s).")
@click.option("--shared-cores/--no-shared-cores", default=CompareOptions.shared_cores, show_default=True,
              help="Whether the planner knows that the peers share this machine's cores (the cluster spec's "
                   "shared_cores; off: it plans as if each peer had processors of its own, Algorithm 1).")
@click.option("--observe-transfer-costs/--fixed-transfer-costs", default=CompareOptions.observe_transfer_costs,
              show_default=True,
              help="Whether the planner's read latency and scatter dispatch follow what the peers measure reads and "
                   "scatters take (the cluster spec's observe_transfer_costs; fixed: the two values above).")
@click.option("--log-level", type=click.Choice(("debug", "info", "warning", "error")),
              default=CompareOptions.log_level, show_default=True,
              help="The peers' log level (debug: per combine, how long its remote KV took).")
@click.option("--data", "data_dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench_results"),
              show_default=True)
@click.option("--write-docs", is_flag=True,
              help=f"Also write the results page {DOCS_RESULTS}/main-job.md (and its plot) under the working "
                   "directory.")
def compare(model, download, data_dir, out_dir, write_docs, **options) -> None:
    """Start a local cluster per policy (pc, local-pic, nebula), replay a workload slice, print the comparison."""
    options["policies"] = tuple(dict.fromkeys(options["policies"])) or CompareOptions.policies
    opts = CompareOptions(**options)
    model = str(cluster_compare.bench_model_dir()) if model == "bench-qwen3" else _resolved(model, download)
    threads = f", {opts.threads_per_peer} thread(s) each" if opts.threads_per_peer else ""
    click.echo(f"replaying {opts.num_requests} {opts.trace} requests at {opts.qps:g} req/s on "
               f"{opts.prefill_workers} prefill + {opts.decode_workers} decode peers{threads}, "
               f"{opts.kv_tokens_per_peer:,} KV tokens per peer, model {Path(model).name}; per policy:", err=True)
    started = time.monotonic()
    rows = cluster_compare.compare(model, opts, out_dir, data_dir)
    document = json.loads((out_dir / "compare.json").read_text())
    click.echo(format_table(rows, document["hit_ratio_bound"]))
    if write_docs:
        click.echo(f"wrote {write_page(main_job_page(document, out_dir / 'compare.png'))}")
    click.echo(f"wrote {out_dir / 'compare.json'} and {out_dir / 'compare.png'}; peer logs in {out_dir / 'logs'} "
               f"({time.monotonic() - started:.0f} s in all)")


def _resolved(model: str, download: bool) -> str:
    from nebula_engine.config import resolve_model

    try:
        path = resolve_model(model, download=download)
    except (FileNotFoundError, RuntimeError) as error:  # not downloaded, or the download failed
        raise click.UsageError(str(error)) from error
    return str(Path(path).resolve()) if Path(path).exists() else path

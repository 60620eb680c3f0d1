"""`nebula-engine profile`: measure this engine on this machine, write a profile for `simulate --profile`."""

from __future__ import annotations

from pathlib import Path

import click

from nebula_engine.cli.options import DEVICE, DTYPE


@click.command("profile")
@click.option("--model", default=None,
              help="Checkpoint dir or model name the engine accepts [default: the random Qwen3 `compare` uses].")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=Path("profile.json"),
              show_default=True)
@click.option("--device", type=DEVICE, default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--dtype", type=DTYPE, default="float32", show_default=True)
@click.option("--page-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--num-pages", type=click.IntRange(min=64), default=2048, show_default=True,
              help="Device pool per worker (sets the profile's cache capacity) [default: compare's].")
@click.option("--host-cache-tokens", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=16), default=2048, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="Timed runs per point (median).")
@click.option("--backend", "backends", multiple=True,
              help="PIC backend to measure, repeatable [default: every backend the model supports].")
@click.option("--transfer", type=click.Choice(["auto", "nixl", "copy"]), default="auto", show_default=True,
              help="How KV moves between workers: NIXL over loopback (auto: when NIXL imports) or an in-process copy.")
def profile(model: str | None, out_path: Path, backends: tuple[str, ...], **options) -> None:
    """Measure prefill, per-backend combine cost and KV transfer on this machine; write a profile JSON."""
    from nebula_engine.bench.profile import ProfileOptions, build_profile, write_profile

    if model is None:
        from nebula_engine.bench.cluster_compare import bench_model_dir

        model = str(bench_model_dir())
    elif Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())
    settings = ProfileOptions(model=model, backends=backends or None, **options)
    try:
        data = build_profile(settings, log=lambda line: click.echo(line, err=True))
    except (OSError, ValueError, RuntimeError) as error:
        raise click.ClickException(f"profiling {model} failed: {error}") from error
    write_profile(data, out_path)
    click.echo(f"wrote {out_path} (simulate with --profile {out_path})")

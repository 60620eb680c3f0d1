"""``nebula-engine prefill``: warm a PIC disk tier from a JSONL corpus, so serving engines start warm.

Serving engines hit what it wrote only when started with the same ``--model`` string, ``--dtype``, PIC backend
(cache format) and ``--page-size``, and a disk tier (``disk_cache_path``) pointing at the same directory.
"""

from __future__ import annotations

from pathlib import Path

import click

from nebula_engine.cli.options import DEVICE, DTYPE, check_local_model


@click.command()
@click.option("--model", required=True,
              help="Checkpoint directory, .gguf file, short name or Hugging Face id: the same string serving uses.")
@click.option("--input", "input_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help='JSONL corpus: one object per line with "text" (or "token_ids") and an optional "id".')
@click.option("--disk-cache-path", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory of the disk tier to fill (created if missing); serving engines read it.")
@click.option("--pic-backend", default="auto", show_default=True,
              help="PIC backend spec whose cache format keys the entries, e.g. epic, hypic, cacheblend.")
@click.option("--disk-cache-tokens", type=click.IntRange(min=1), default=None,
              help="Disk tier capacity in tokens; the least recently written are dropped beyond it (default: no limit).")
@click.option("--page-size", type=click.IntRange(min=1), default=16, show_default=True, help="Tokens per KV page.")
@click.option("--num-pages", type=click.IntRange(min=1), help="KV pool size (default: from a 1 GiB budget).")
@click.option("--max-model-len", type=click.IntRange(min=2), help="Longer documents are reported and skipped.")
@click.option("--dtype", type=DTYPE, default="float32", show_default=True)
@click.option("--device", type=DEVICE, default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Stop after this many non-blank lines.")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="Documents between disk flushes (bounds the payloads waiting to be written).")
def prefill(model, input_path, disk_cache_path, pic_backend, disk_cache_tokens, page_size, num_pages, max_model_len,
            dtype, device, limit, batch_size):
    """Prefill each corpus document alone as a PIC segment and store it on the disk tier; skips documents
    already there, so rerunning resumes."""
    from tqdm import tqdm

    from nebula_engine.engine.offline_prefill import UNLIMITED_DISK_TOKENS, OfflinePrefill, build_prefill_engine

    if not input_path.is_file():
        raise click.BadParameter(f"no such file: {input_path}", param_hint="--input")
    check_local_model(model)
    options = {k: v for k, v in dict(page_size=page_size, num_pages=num_pages, max_model_len=max_model_len,
                                     dtype=dtype, device=device).items() if v is not None}
    try:
        runner = OfflinePrefill(build_prefill_engine(model, disk_cache_path, pic_backend or "auto",
                                                     disk_cache_tokens or UNLIMITED_DISK_TOKENS, **options),
                                batch_size)
    except (OSError, ValueError, ImportError) as exc:  # missing checkpoint or gguf extra, bad backend spec, page size
        raise click.UsageError(str(exc)) from exc
    total = _count_documents(input_path, limit)
    try:
        with tqdm(total=total, unit="doc", desc="prefill") as bar:
            def on_outcome(outcome):
                if outcome.status == "failed":
                    where = f"line {outcome.line}" + (f" (id {outcome.doc_id})" if outcome.doc_id else "")
                    bar.write(f"{input_path}: {where}: {outcome.reason}")
                bar.update(1)
            report = runner.run(input_path, limit, on_outcome)
    finally:
        runner.close()
    _print_report(report, runner, disk_cache_path)


def _count_documents(path: Path, limit: int | None) -> int:
    with open(path, "rb") as corpus:
        count = sum(1 for line in corpus if line.strip())
    return count if limit is None else min(count, limit)


def _print_report(report, runner, disk_cache_path: Path) -> None:
    click.echo(f"prefilled {report.prefilled} documents ({report.prefilled_tokens} tokens), "
               f"skipped {report.skipped} already on disk, failed {report.failed}")
    if report.evicted_from_disk:
        click.echo(f"warning: the disk tier dropped {report.evicted_from_disk} entries to stay within "
                   "--disk-cache-tokens; raise it to keep the whole corpus", err=True)
    click.echo(f"disk tier {disk_cache_path}: model {runner.format.model_id!r}, "
               f"PIC backend {runner.format.backend_spec}, page size {runner.kv.page_size}")

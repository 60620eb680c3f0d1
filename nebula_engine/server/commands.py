"""``nebula-engine serve``: the OpenAI-compatible HTTP API over one local engine."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--model", help="Checkpoint directory or Hugging Face id (default: a tiny random Qwen3).")
@click.option("--served-model-name", help="The name clients put in 'model' (default: the --model value).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--pic-backend", help="PIC backend spec for <pic> segments of requests that name none, e.g. "
                                    "'epic' or 'cacheblend:ratio=0.3'; 'none': PIC off (default: auto).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--attention-backend", default="torch", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds requests that carry no seed.")
@click.option("--page-size", type=click.IntRange(min=1), default=16, show_default=True, help="Tokens per KV page.")
@click.option("--num-pages", type=click.IntRange(min=1), help="KV pool size (default: from a 1 GiB budget).")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True)
@click.option("--max-model-len", type=click.IntRange(min=2), help="Prompt + output tokens per request.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def serve(model, served_model_name, host, port, log_level, **engine_options):
    """Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics."""
    import uvicorn

    from nebula_engine.server.api import build_app

    engine = _start_engine(model, engine_options)
    name = served_model_name or model or "tiny-qwen3"
    app = build_app(engine, name)
    click.echo(f"serving {name!r} (max_model_len {engine.max_model_len}) on http://{host}:{port}", err=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        engine.shutdown()


def _start_engine(model: str | None, engine_options: dict):
    from nebula_engine.config import EngineConfig
    from nebula_engine.engine.async_engine import AsyncLLMEngine
    from nebula_engine.engine.commands import default_model_dir

    if model and model.startswith(("/", ".", "~")) and not Path(model).expanduser().is_dir():
        raise click.BadParameter(f"no checkpoint directory at {model}", param_hint="--model")
    options = {k: v for k, v in engine_options.items() if v is not None}
    if options.get("pic_backend") == "none":
        options["pic_backend"] = None
    try:
        return AsyncLLMEngine.from_config(EngineConfig.create(model or str(default_model_dir()), **options))
    except (OSError, ValueError) as exc:  # a missing checkpoint, a bad option value (PIC backend spec, sizes)
        raise click.UsageError(f"cannot start the engine: {exc}") from exc

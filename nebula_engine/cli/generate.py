"""``nebula-engine generate``: offline generation, by default on Qwen2.5-Coder-0.5B-Instruct (``qwen2.5-coder-0.5b``)."""

from __future__ import annotations

import time

import click

from nebula_engine.cli.options import DEVICE, DTYPE, check_local_model

DEFAULT_PROMPTS = (
    "The capital of France is",
    "Write a haiku about paged attention:",
    "In one sentence, position-independent caching means",
    "1, 2, 3, 4,",
)


@click.command()
@click.option("--model", help="Checkpoint directory, .gguf file, catalog name (qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, "
                               "smollm2) or Hugging Face id [default: qwen2.5-coder-0.5b].")
@click.option("--download", is_flag=True, help="Fetch a catalog model that is not downloaded yet.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text; repeat for a batch.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="0 means greedy.")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=-1), default=0, show_default=True, help="0 or -1: no limit.")
@click.option("--seed", type=int, default=None, help="Per-request sampling seed.")
@click.option("--dtype", type=DTYPE, default="float32", show_default=True)
@click.option("--device", type=DEVICE, default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--chat", is_flag=True, help="Send each prompt as a user message through the chat template.")
def generate(model, download, prompts, max_tokens, temperature, top_p, top_k, seed, dtype, device, chat):
    """Generate completions for a few prompts and print them with throughput."""
    from nebula_engine import LLM, SamplingParams
    from nebula_engine.config import DEFAULT_MODEL

    check_local_model(model)
    try:
        llm = LLM(model or DEFAULT_MODEL, dtype=dtype, device=device, download=download)
    except (OSError, ValueError, ImportError, RuntimeError) as exc:  # missing model or extra, failed download, ...
        raise click.BadParameter(str(exc), param_hint="--model") from exc
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    prompts = list(prompts) or list(DEFAULT_PROMPTS)
    start = time.perf_counter()
    try:
        if chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--prompt") from exc
    elapsed = time.perf_counter() - start
    _print_outputs(outputs, prompts, elapsed)


def _print_outputs(outputs, prompts, elapsed: float) -> None:
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        click.echo(f"prompt: {prompt!r}")
        click.echo(f"output: {completion.text!r}  [{len(completion.token_ids)} tokens, {completion.finish_reason}]")
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    click.echo(f"{len(outputs)} requests, {num_prompt} prompt + {num_output} generated tokens in {elapsed:.2f} s: "
               f"{(num_prompt + num_output) / elapsed:.1f} tok/s total, {num_output / elapsed:.1f} generated tok/s")

"""Write a tiny random HF-format checkpoint with a real tokenizer.

    python tools/make_tiny_checkpoint.py qwen3_moe /tmp/tiny-moe --hidden 96 --layers 4 --set num_experts=16
"""

from __future__ import annotations

import json

import click

from nebula_engine.model.tiny import TINY_FAMILIES, make_tiny_checkpoint


def _parse_overrides(pairs: tuple[str, ...]) -> dict:
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--set")
        overrides[key] = json.loads(value)  # JSON so that numbers, lists and booleans keep their types
    return overrides


@click.command()
@click.argument("family", type=click.Choice(TINY_FAMILIES))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--hidden", "hidden_size", type=int, help="hidden_size")
@click.option("--layers", "num_hidden_layers", type=int, help="num_hidden_layers")
@click.option("--heads", "num_attention_heads", type=int, help="num_attention_heads")
@click.option("--kv-heads", "num_key_value_heads", type=int, help="num_key_value_heads")
@click.option("--head-dim", "head_dim", type=int, help="head_dim")
@click.option("--intermediate", "intermediate_size", type=int, help="intermediate_size")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--set", "extra", multiple=True, help="any HF config field as KEY=JSON_VALUE (repeatable)")
def main(family: str, out_dir: str, seed: int, extra: tuple[str, ...], **sizes) -> None:
    overrides = {key: value for key, value in sizes.items() if value is not None}
    path = make_tiny_checkpoint(family, out_dir, seed=seed, **overrides, **_parse_overrides(extra))
    click.echo(f"wrote {family} checkpoint to {path}")


if __name__ == "__main__":
    main()

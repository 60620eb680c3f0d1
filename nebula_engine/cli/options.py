"""Click parameter types and checks shared by the commands."""

from __future__ import annotations

from pathlib import Path

import click

from nebula_engine.devices import DeviceError, check_device

# the torch dtypes the engine runs its weights and KV in
DTYPE = click.Choice(["float32", "bfloat16", "float16"])


class DeviceType(click.ParamType):
    """A torch device string the engine can run on here (checked when the command runs, before any model loads)."""

    name = "device"

    def convert(self, value, param, ctx):
        try:
            check_device(str(value))
        except DeviceError as error:
            self.fail(str(error), param, ctx)
        return str(value)


DEVICE = DeviceType()


def check_local_model(model: str | None) -> None:
    """A ``--model`` spelled as a path must exist (a checkpoint directory or a .gguf file)."""
    if model and model.startswith(("/", ".", "~")) and not Path(model).expanduser().exists():
        raise click.BadParameter(f"no checkpoint directory or .gguf file at {model}", param_hint="--model")

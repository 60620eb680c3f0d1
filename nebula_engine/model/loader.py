"""Find a checkpoint (local dir, .gguf file or hub id), build the model for its ``model_type``, load its weights."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nebula_engine.kernels import cpu_paged_decode
from nebula_engine.kernels.cpu_linear import prepack
from nebula_engine.model.config import ModelConfig
from nebula_engine.model.registry import get_model_class

_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.tiktoken", "*.model", "*.txt"]
QUANTIZATIONS = ("gguf", "float32")  # what a GGUF file's quantized weights become (``load_model``)


def resolve_checkpoint(model: str, revision: str | None = None) -> Path:
    """Where ``model``'s weights are: a ``.gguf`` file, a checkpoint directory, or a hub id's snapshot (at
    ``revision``: a branch, tag or commit; None = the default branch).

    A directory without ``config.json`` that holds exactly one ``.gguf`` file means that file. A local path has
    no revisions: asking for one is a ValueError rather than a silently ignored pin.
    """
    path = Path(model).expanduser()
    if revision is not None and path.exists():
        raise ValueError(f"revision={revision!r} names a Hugging Face hub revision, but {model!r} is a local path "
                         "(it has no revisions): drop revision or give a hub id")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; give a checkpoint directory or a .gguf file")
        return path
    if path.is_dir():
        return _single_gguf(path) if not (path / "config.json").is_file() else path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(repo_id=model, allow_patterns=_HUB_FILES, local_files_only=offline,
                                      revision=revision))
    except LocalEntryNotFoundError as exc:
        hint = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else "it could not be fetched"
        raise FileNotFoundError(f"{model!r} is not a local directory and {hint}: {exc}") from exc


def _single_gguf(directory: Path) -> Path:
    """The one ``.gguf`` in a directory with no config.json (else the directory, for a clear error later)."""
    files = sorted(directory.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{directory} holds {len(files)} .gguf files ({', '.join(f.name for f in files)}) "
                         "and no config.json: name the file to load")
    return files[0] if files else directory


def safetensors_files(checkpoint_dir: Path) -> list[Path]:
    """Shards listed in ``model.safetensors.index.json``, else ``model.safetensors``, else ``*.safetensors``."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [checkpoint_dir / shard for shard in shards]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"shard {file.name} named in {index.name} is missing from {checkpoint_dir}")
        return files
    single = checkpoint_dir / "model.safetensors"
    files = [single] if single.is_file() else sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {checkpoint_dir}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from every file, read lazily one tensor at a time on CPU."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    yield name, reader.get_tensor(name)
        except SafetensorError as exc:
            raise ValueError(f"corrupt or truncated safetensors file {file}: {exc}") from exc


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# the in-place random initialisers of torch.nn.init that layers' reset_parameters call
_RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                 "xavier_uniform_", "xavier_normal_", "orthogonal_")


@contextlib.contextmanager
def _without_random_init() -> Iterator[None]:
    """Parameters keep torch.empty's pages untouched: a checkpoint overwrites every one of them (load_weights
    raises on a missing one), and initialising them first made a 1.5B model's load peak at ~6 GB of fp32 weights
    that GGUF blocks then replace (measured: a peer's anonymous memory 8.4 GiB while loading, 2.1 GiB after)."""
    saved = {name: getattr(nn.init, name) for name in _RANDOM_INITS}
    for name in _RANDOM_INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", initialise: bool = True) -> nn.Module:
    """An (unloaded) model of ``config``'s family with parameters in ``dtype`` on ``device``; randomly
    initialised unless ``initialise`` is False (then values are whatever memory held, for a load to overwrite).

    RoPE frequency buffers are created explicitly in fp32 and so stay fp32.
    """
    model_class = get_model_class(config.model_type)
    with _default_dtype(dtype), torch.device(device), (
            contextlib.nullcontext() if initialise else _without_random_init()):
        return model_class(config)


def load_model(model: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               revision: str | None = None, quantization: str = "gguf") -> tuple[nn.Module, ModelConfig, Path]:
    """Resolve ``model`` (dir, .gguf file or hub id at ``revision``), build it and load its weights.

    ``quantization`` (``QUANTIZATIONS``) says what a GGUF file's quantized linear weights become on CPU in fp32:
    "gguf" keeps their blocks (``kernels.quant_linear``), "float32" dequantizes them at load. Other devices and
    dtypes always dequantize (the quantized kernel is CPU-only).

    Returns (module, config, source): the checkpoint directory or the .gguf file, where its tokenizer is too.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    source = resolve_checkpoint(model, revision)
    if source.suffix == ".gguf" and source.is_file():
        from nebula_engine.model.gguf_loader import GGUFCheckpoint

        gguf = GGUFCheckpoint(source)
        config = ModelConfig.from_hf(gguf.hf_config())
        weights = gguf.weights(dtype, keep_blocks=quantization == "gguf" and torch.device(device).type == "cpu")
    else:
        config = ModelConfig.from_hf(source)
        weights = iter_safetensors(safetensors_files(source))
    module = build_model(config, dtype, device, initialise=False)
    module.load_weights(weights)
    # an inference engine: a forward that runs outside inference mode by mistake must not record autograd history
    # (it kept every scatter prefill's activations alive through the KV pool it wrote to, ~1 GB per peer per
    # 48 requests)
    module.requires_grad_(False)
    prepack(module)
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        cpu_paged_decode.load()  # built now (once per machine, ~8 s), not in a server's first decode step
    return module.eval(), config, source

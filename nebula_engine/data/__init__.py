"""Data files shipped inside the package, declared as package data in pyproject.toml so a wheel install has them.

``ragpulse/``: the first 1,000 lines of the RAGPulse trace, verbatim, with its MIT ``NOTICE`` beside it. Torch-free;
imports nothing of the package.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def bundled_dir() -> Path:
    """The folder holding the bundled data (one subfolder per trace slice), as importlib.resources finds it."""
    root = files(__name__)
    if not isinstance(root, Path):  # the package imported from a zip: the loaders read directories
        raise RuntimeError(f"the bundled traces are inside {root}; install nebula-engine as files, not a zip")
    return root

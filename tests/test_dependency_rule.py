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


# ---- the cluster reaches its engine only through the engine's two ports ----
CLUSTER = PACKAGE / "cluster"
# What cluster code may import of ``nebula_engine.engine``: module -> the names it may take (None: any of them).
ENGINE_API: dict[str, frozenset[str] | None] = {
    "nebula_engine.engine.kv_port": None,  # the KV port: pins, reads, imports, pages, segment prefill, cache events
    "nebula_engine.engine.request_port": None,  # the request port: admit, submit with a KVPlan, hand-offs, stats
    "nebula_engine.engine.port_types": None,  # the data both ports hand out and the errors they raise
    "nebula_engine.engine.kv_plan": None,  # KVPlan: the one request-level plan a request is submitted with
    "nebula_engine.engine.kv_gate": None,  # KVGate: the latch a KVPlan carries; a lock and a set, no engine state
    "nebula_engine.engine.sampling_params": None,  # SamplingParams: a request's parameters, plain data
    "nebula_engine.engine.outputs": None,  # RequestOutput and its parts: what a request streams back, plain data
    # plain data or pure functions out of modules that also hold engine machinery:
    "nebula_engine.engine.structured_outputs": frozenset({"StructuredOutputsParams"}),  # a SamplingParams field
    "nebula_engine.engine.tokenizer": frozenset({"Tokenizer"}),  # the type of ``RequestPort.tokenizer``
    "nebula_engine.engine.parallel_sampling": frozenset({"ParentRequest", "child_request_id"}),  # n > 1 over outputs
    "nebula_engine.engine.output_processor": frozenset({"find_stop_string"}),  # a stop string across an attempt seam
}
# The composition roots build the engine they then wrap in the ports (and reach only through them).
COMPOSITION_ROOT = {"nebula_engine.cluster.runtime.peer": {"nebula_engine.engine.async_engine": {"AsyncLLMEngine"}},
                    "nebula_engine.engine.offline_prefill": {"nebula_engine.engine.async_engine": {"AsyncLLMEngine"}}}
# Engine modules that use the engine as the cluster does, through its ports alone.
PORT_USERS_IN_ENGINE = ("offline_prefill.py",)

# Names of the engine's internals (``LLMEngine``, ``AsyncLLMEngine`` and the cache, scheduler and model runner they
# hold) that mean nothing else in cluster code: an attribute of one of these names is never read there.
ENGINE_INTERNALS = frozenset({
    "model_runner", "cache_store", "cache_lock", "scheduler_config", "model_config", "output_processor",
    "grammar_compiler", "pic_executor", "kv_storage", "layer_caches", "kv_cache", "prefix_cache", "radix", "pool",
    "call", "call_cache", "add_request", "add_admitted", "add_prefilled", "abort_request", "has_unfinished_requests",
    "has_schedulable_requests", "reset_prefix_cache", "resolve_request_backend", "held_block_table",
    "held_linear_state", "lookup_or_prefill_many", "lookup_segment", "insert_segment", "insert_prefix",
    "match_prefix", "inc_lock_ref", "dec_lock_ref", "drain_events",
})
# Engine attributes whose names cluster code also uses for its own things (the control plane has a ``scheduler``, a
# worker a ``prefill``, a message a ``pic_backend``, ...): caught only when read off something named as an engine,
# as is any attribute of such a thing (cluster code holds ports, never an engine).
ENGINE_AMBIGUOUS = frozenset({"config", "scheduler", "step", "abort", "prefill", "pic_backend", "from_config"})
ENGINE_RECEIVERS = frozenset({"engine", "llm_engine", "async_engine", "_engine", "_async"})
ENGINE_SOURCE = PACKAGE / "engine"  # the real engine, also while a test points PACKAGE at a probe


def engine_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for each import of ``nebula_engine.engine`` in ``path`` (name None: the module itself),
    ``if TYPE_CHECKING:`` blocks included: what the types name is part of what the code depends on."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                package = module_name(path).split(".")[:None if path.name == "__init__.py" else -1]
                module = ".".join(package[:len(package) - node.level + 1] + ([module] if module else []))
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.append((submodule, None) if is_module(submodule) else (module, alias.name))
    return [(m, n) for m, n in found if m == "nebula_engine.engine" or m.startswith("nebula_engine.engine.")]


def port_user_files() -> list[Path]:
    """The cluster's modules and the engine's own port users (offline batch prefill)."""
    engine = PACKAGE / "engine"
    return sorted(CLUSTER.rglob("*.py")) + [engine / name for name in PORT_USERS_IN_ENGINE
                                            if (engine / name).exists()]


def engine_import_violations() -> list[str]:
    found = []
    for path in port_user_files():
        source = module_name(path)
        allowed = {**ENGINE_API, **COMPOSITION_ROOT.get(source, {})}
        for module, name in engine_imports(path):
            names = allowed.get(module, frozenset())
            if module not in allowed or (names is not None and (name is None or name not in names)):
                found.append(f"{source} imports {module}" + (f".{name}" if name else ""))
    return found


def attribute_chain(node: ast.Attribute) -> list[str]:
    """``a.b.c`` -> ["a", "b", "c"]; a receiver that is not a name (a call, a subscript) counts as "?"."""
    chain = [node.attr]
    value = node.value
    while isinstance(value, ast.Attribute):
        chain.append(value.attr)
        value = value.value
    chain.append(value.id if isinstance(value, ast.Name) else "?")
    return chain[::-1]


def port_private_names() -> set[str]:
    """The ports' own private fields and helpers (``_async``, ``_call``, ...): what lies behind a port."""
    names: set[str] = set()
    for module in ("kv_port", "request_port"):
        for node in ast.walk(ast.parse((ENGINE_SOURCE / f"{module}.py").read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_") \
                    and not node.name.startswith("__"):
                names.add(node.name)
    return names


def reach_violations() -> list[str]:
    private = port_private_names()
    found = []
    for path in port_user_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            chain = attribute_chain(node)
            receiver, name = chain[-2], chain[-1]
            if (name in ENGINE_INTERNALS or name == "engine" or receiver in ENGINE_RECEIVERS
                    or (name in private and receiver not in ("self", "cls"))):
                found.append(f"{module_name(path)}:{node.lineno}: {'.'.join(chain)}")
    return found


def test_the_cluster_and_offline_prefill_import_of_the_engine_only_its_ports_and_plain_data():
    assert engine_import_violations() == []


def test_neither_cluster_code_nor_offline_prefill_reaches_past_a_port_into_the_engine():
    assert reach_violations() == []


def engine_class_attributes() -> set[str]:
    """Every public attribute and method of ``LLMEngine`` and ``AsyncLLMEngine``, read from their source."""
    names: set[str] = set()
    for module, cls in (("llm_engine", "LLMEngine"), ("async_engine", "AsyncLLMEngine")):
        tree = ast.parse((ENGINE_SOURCE / f"{module}.py").read_text())
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        names |= {node.name for node in body.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for node in ast.walk(body):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                  and isinstance(node.ctx, ast.Store)):
                names.add(node.attr)
    return {name for name in names if not name.startswith("_")}


def test_every_engine_attribute_is_either_a_port_operation_or_forbidden_to_the_cluster():
    """A new ``LLMEngine`` / ``AsyncLLMEngine`` attribute is classified here: offered by a port, or an internal."""
    from nebula_engine.engine.kv_port import KVPort
    from nebula_engine.engine.request_port import RequestPort

    offered = set(dir(KVPort)) | set(dir(RequestPort)) | {"page_size", "kv_geometry", "caches_prefixes",
                                                          "combines_start_after_prefix"}
    unclassified = engine_class_attributes() - offered - ENGINE_INTERNALS - ENGINE_AMBIGUOUS - {"engine"}
    assert unclassified == set()


@pytest.mark.parametrize("line, expected", [
    ("from nebula_engine.engine.llm_engine import LLMEngine",
     "nebula_engine.cluster.runtime.probe imports nebula_engine.engine.llm_engine.LLMEngine"),
    ("from nebula_engine.engine.output_processor import OutputProcessor",
     "nebula_engine.cluster.runtime.probe imports nebula_engine.engine.output_processor.OutputProcessor"),
    ("import nebula_engine.engine.async_engine",
     "nebula_engine.cluster.runtime.probe imports nebula_engine.engine.async_engine"),
], ids=["engine-internals", "a-name-beyond-the-allowed-one", "the-async-engine-outside-the-composition-root"])
def test_the_import_rule_catches_an_engine_internal(tmp_path, monkeypatch, line, expected):
    package = tmp_path / "nebula_engine"
    for directory in ("cluster/runtime", "engine"):
        (package / directory).mkdir(parents=True)
        (package / directory / "__init__.py").write_text("")
    for module in ("llm_engine", "output_processor", "async_engine"):
        (package / "engine" / f"{module}.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "cluster" / "__init__.py").write_text("")
    (package / "cluster" / "runtime" / "probe.py").write_text(f"def f():\n    {line}\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    monkeypatch.setattr(sys.modules[__name__], "CLUSTER", package / "cluster")
    assert engine_import_violations() == [expected]


@pytest.mark.parametrize("line, expected", [
    ("self.kv._engine.cache_store.pool.release(pages)", "self.kv._engine.cache_store"),
    ("peer.engine.scheduler.waiting", "peer.engine"),
    ("engine.scheduler.waiting", "engine.scheduler"),
    ("self.requests._async.call(fn)", "self.requests._async"),
    ("radix = store.radix", "store.radix"),
], ids=["cache-store-behind-a-port", "an-engine-attribute", "the-scheduler-of-an-engine", "a-port-private-field",
        "the-radix-tree"])
def test_the_reach_rule_catches_a_chain_past_a_port(tmp_path, monkeypatch, line, expected):
    cluster = tmp_path / "nebula_engine" / "cluster"
    cluster.mkdir(parents=True)
    (cluster / "probe.py").write_text(f"def f(self, peer, engine, store, pages, fn):\n    {line}\n")
    monkeypatch.setattr(sys.modules[__name__], "CLUSTER", cluster)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "nebula_engine")
    found = reach_violations()
    assert found and all(entry.startswith("nebula_engine.cluster.probe:2: ") for entry in found)
    assert any(entry.endswith(": " + expected) for entry in found)

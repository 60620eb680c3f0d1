"""The command group imports no subcommand until one runs; a missing optional module names its extra."""

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from nebula_engine.cli import COMMANDS, load_command, main
from nebula_engine.extras import MissingExtra, missing_extra, require_extra

PACKAGE = Path(__file__).resolve().parents[2] / "nebula_engine"
HEAVY = ("torch", "transformers", "numpy", "fastapi", "uvicorn", "nebula_engine.cluster", "nebula_engine.engine.llm",
         "nebula_engine.server", "nebula_engine.bench", "nebula_engine.model")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def imported_after(code: str) -> list[str]:
    """Modules from HEAVY that ``code`` leaves imported in a fresh interpreter."""
    probe = run_python(code + "\nimport json, sys\n"
                       f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({HEAVY!r}))))")
    assert probe.returncode == 0, probe.stderr
    return json.loads(probe.stdout.strip().splitlines()[-1])


def test_importing_the_cli_imports_no_heavy_module():
    assert imported_after("import nebula_engine.cli") == []


def test_the_top_level_help_lists_every_command_without_importing_one():
    code = ("from nebula_engine.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n")
    assert imported_after(code) == []
    listing = CliRunner().invoke(main, ["--help"])
    assert listing.exit_code == 0
    for name in COMMANDS:
        assert f"  {name} " in listing.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_listed_summary_is_the_first_sentence_of_the_commands_help(name):
    command = load_command(name)
    assert command.name == name
    help_text = " ".join(command.help.split())
    first_sentence = help_text.split(". ")[0].rstrip(".") + "."
    assert COMMANDS[name] == first_sentence


def test_each_command_is_the_cli_module_of_its_name():
    modules = {path.stem for path in (PACKAGE / "cli").glob("*.py")} - {"__init__", "group", "options"}
    assert modules == set(COMMANDS)


def test_no_module_outside_the_cli_package_defines_a_command():
    defining = [path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                if "cli" not in path.relative_to(PACKAGE).parts[:1]
                and ("@click.command" in path.read_text() or "@click.group" in path.read_text())]
    assert defining == []


def test_a_subcommand_runs_through_the_lazy_group():
    result = CliRunner().invoke(main, ["simulate", "--help"])
    assert result.exit_code == 0 and "--workload" in result.output
    assert CliRunner().invoke(main, ["no-such-command"]).exit_code == 2


def blocked(modules: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in an interpreter where ``modules`` cannot be imported (as when their extra is not installed)."""
    block = "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    return run_python("import sys\n" + block + code)


def test_a_command_whose_module_needs_a_missing_extra_says_which_in_one_line():
    result = blocked(("aiohttp",), "from nebula_engine.cli import main\nmain(['compare', '--help'])")
    assert result.returncode == 1
    assert result.stderr.strip() == "Error: aiohttp is not installed: pip install 'nebula-engine[bench]'"


def test_a_command_that_imports_a_missing_extra_when_it_runs_says_which_in_one_line():
    run = "main(['bench', '--url', 'http://127.0.0.1:9', '--trace', 'ragpulse', '--qps', '1'])"
    result = blocked(("aiohttp",), "from nebula_engine.cli import main\n" + run)
    assert result.returncode == 1
    assert result.stderr.strip() == "Error: aiohttp is not installed: pip install 'nebula-engine[bench]'"
    assert blocked(("aiohttp",), "from nebula_engine.cli import main\nmain(['bench', '--help'])").returncode == 0


def test_the_cluster_transport_names_the_cluster_extra():
    result = blocked(("zmq",), "import nebula_engine.cluster.runtime.transport")
    assert result.returncode == 1
    assert "MissingExtra: zmq is not installed: pip install 'nebula-engine[cluster]'" in result.stderr


def test_require_extra_returns_the_module_or_names_the_extra(tmp_path, monkeypatch):
    assert require_extra("json", "none") is json
    with pytest.raises(MissingExtra, match=r"^nebula_no_such_module is not installed: "
                                           r"pip install 'nebula-engine\[gpu\]'$"):
        require_extra("nebula_no_such_module.sub", "gpu")
    # installed, but broken by something else it imports: that error is not the extra's to explain
    (tmp_path / "nebula_broken_pkg.py").write_text("import nebula_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as caught:
        require_extra("nebula_broken_pkg", "gpu")
    assert not isinstance(caught.value, MissingExtra) and caught.value.name == "nebula_missing_dependency"


def test_a_raw_missing_module_maps_to_its_extra():
    assert str(missing_extra(ModuleNotFoundError("x", name="numba.core"))) == \
        "numba is not installed: pip install 'nebula-engine[cluster]'"
    assert missing_extra(ModuleNotFoundError("x", name="some_unrelated_module")) is None
    assert missing_extra(ImportError("cannot import name 'x'")) is None


def test_the_group_turns_a_missing_extra_during_a_run_into_a_click_error(monkeypatch):
    @click.command("boom")
    def boom():
        raise ModuleNotFoundError("No module named 'gguf'", name="gguf")

    monkeypatch.setitem(COMMANDS, "boom", "Boom.")
    monkeypatch.setattr("nebula_engine.cli.group.load_command", lambda name: boom)
    result = CliRunner().invoke(main, ["boom"])
    assert result.exit_code == 1
    assert result.output.strip() == "Error: gguf is not installed: pip install 'nebula-engine[gguf]'"

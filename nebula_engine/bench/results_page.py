"""One Markdown page per benchmark under ``docs/results/``, written by the tool that measured it (``--write-docs``).

A page says what was measured, on which machine (CPU model, cores, memory, OS, Python, torch), by which exact
command and on which date, then gives the tool's table(s) and, when the tool draws one, its PNG beside the page.
The README's figures link to these pages, so every number a user reads names the run that produced it.

Torch-free: the torch version is read from the installed package's metadata, so the simulator's tools can write
pages without loading it.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

DOCS_RESULTS = Path("docs/results")  # relative to where the tool runs: the repository's root in a checkout


@dataclass(frozen=True)
class Machine:
    """Where a benchmark ran."""

    cpu: str
    cores: int
    memory_gib: float | None
    os: str
    python: str
    torch: str | None

    @classmethod
    def here(cls) -> Machine:
        return cls(cpu=cpu_model(), cores=os.cpu_count() or 0, memory_gib=memory_gib(), os=platform.platform(),
                   python=platform.python_version(), torch=package_version("torch"))

    def lines(self) -> list[str]:
        memory = "unknown" if self.memory_gib is None else f"{self.memory_gib:.1f} GiB"
        return [f"- CPU: {self.cpu}, {self.cores} cores", f"- memory: {memory}", f"- OS: {self.os}",
                f"- Python {self.python}, torch {self.torch or 'not installed'}"]


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's marketing name (Linux ``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def memory_gib(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """Total memory (Linux ``/proc/meminfo``, else ``sysconf``), GiB; None where neither answers."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def invoked_command(argv: list[str] | None = None) -> str:
    """The command line as a user would type it again: ``nebula-engine ...`` for the console script,
    ``python tools/x.py ...`` for a script (its path relative to the working directory when it lies below it)."""
    argv = list(sys.argv if argv is None else argv)
    program = Path(argv[0])
    if program.suffix != ".py":
        return shlex.join([program.name, *argv[1:]])
    try:
        program = program.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        pass
    return shlex.join(["python", str(program), *argv[1:]])


@dataclass(frozen=True)
class Table:
    """A Markdown table: a header row, rows of cells (any value; shown with ``str``), and an optional caption."""

    header: tuple[str, ...]
    rows: tuple[tuple, ...]
    caption: str = ""

    def __post_init__(self) -> None:
        widths = {len(row) for row in self.rows}
        if widths - {len(self.header)}:
            raise ValueError(f"every row needs {len(self.header)} cells (the header's), got rows of {sorted(widths)}")

    def markdown(self) -> str:
        lines = [f"{self.caption}", ""] if self.caption else []
        lines.append(_row(self.header))
        lines.append("|" + "---|" * len(self.header))
        lines += [_row(row) for row in self.rows]
        return "\n".join(lines)


def _row(cells) -> str:
    return "| " + " | ".join(str(cell).replace("|", "\\|").replace("\n", " ") for cell in cells) + " |"


@dataclass(frozen=True)
class ResultsPage:
    """What one benchmark run shows: ``name`` is the page's file name (``docs/results/<name>.md``)."""

    name: str
    title: str
    about: str  # what was measured and how to read it, one paragraph
    tables: tuple[Table, ...]
    notes: tuple[str, ...] = ()  # definitions of the columns, caveats of this run
    png: Path | None = None  # a plot the tool wrote; copied beside the page as <name>.png
    command: str = field(default_factory=invoked_command)
    output: str = ""  # text the measured command printed, shown as is (a tool that measures another command)

    def __post_init__(self) -> None:
        if not self.name or Path(self.name).name != self.name or self.name.endswith(".md"):
            raise ValueError(f"a page name is a bare file stem such as 'engine-speed', got {self.name!r}")
        if not self.tables:
            raise ValueError("a results page needs at least one table")

    def markdown(self, machine: Machine, date: datetime.date) -> str:
        parts = [f"# {self.title}", "", self.about, "",
                 f"Written by `{self.command}` on {date.isoformat()}.", "", "Machine:", *machine.lines()]
        for table in self.tables:
            parts += ["", table.markdown()]
        if self.notes:
            parts += ["", *(f"- {note}" for note in self.notes)]
        if self.output:
            parts += ["", "What the command printed last:", "", "```", self.output.rstrip("\n"), "```"]
        if self.png is not None:
            parts += ["", f"![{self.title}]({self.name}.png)"]
        return "\n".join(parts) + "\n"


def write_page(page: ResultsPage, out_dir: Path = DOCS_RESULTS, machine: Machine | None = None,
               date: datetime.date | None = None) -> Path:
    """Write ``out_dir/<name>.md`` (and copy the PNG beside it as ``<name>.png``); returns the page's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if page.png is not None:
        if not Path(page.png).is_file():
            raise FileNotFoundError(f"the page's plot {page.png} does not exist")
        target = out_dir / f"{page.name}.png"
        if Path(page.png).resolve() != target.resolve():
            shutil.copyfile(page.png, target)
    path = out_dir / f"{page.name}.md"
    text = page.markdown(machine or Machine.here(), date or datetime.date.today())
    path.write_text(text)
    return path

"""Peak memory of a command and every process it starts: the sum of their PSS (proportional set size), sampled.

PSS splits each shared page among the processes that map it, so peers that map one GGUF file read-only count it
once between them, and the sum is what the machine gives the whole process tree (Linux ``/proc/PID/smaps_rollup``).

    python tools/peak_memory.py -- nebula-engine compare --model qwen2.5-coder-1.5b --policy nebula \\
        --num-requests 8 --max-prompt-tokens 2048

Prints the peak of the sum, the processes at that moment with their PSS, and the command's exit status (which it
exits with). Standard library only, but for ``--write-docs NAME``, which also writes the results page
docs/results/memory-NAME.md with the peak, the processes and the last lines the command printed.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Sample:
    at_s: float
    pss_kib: dict[int, int]  # pid -> PSS

    @property
    def total_kib(self) -> int:
        return sum(self.pss_kib.values())


def children(pid: int) -> list[int]:
    found = []
    for task in (PROC / str(pid) / "task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def process_tree(root: int) -> list[int]:
    tree, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        tree.append(pid)
        frontier += children(pid)
    return tree


def pss_kib(pid: int) -> int | None:
    try:
        for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def command_line(pid: int) -> str:
    """The process's command line, its program by name alone (a venv's path says nothing about the run)."""
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    return " ".join([Path(argv[0]).name, *argv[1:]]).strip() if argv and argv[0] else "?"


OUTPUT_LINES_KEPT = 20  # the tail of the command's output a results page shows (a compare's summary table fits)


def echo_and_keep(stream, kept: collections.deque) -> None:
    """Copy the command's output to ours line by line, keeping the last lines."""
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        kept.append(line)


def memory_page(name: str, peak: Sample, commands: dict[int, str], returncode: int, output: str):
    from nebula_engine.bench.results_page import ResultsPage, Table

    rows = tuple((f"{kib / 2**20:.2f}", pid, commands.get(pid, "?")[:160])
                 for pid, kib in sorted(peak.pss_kib.items(), key=lambda item: -item[1]))
    table = Table(("PSS GiB", "pid", "process"), rows,
                  f"Peak PSS of the whole process tree: **{peak.total_kib / 2**20:.2f} GiB**, {peak.at_s:.0f} s after "
                  f"the start ({len(peak.pss_kib)} processes); the command exited with status {returncode}.")
    about = ("The memory a command and every process it starts take at their peak, as the sum of their proportional "
             "set sizes (PSS, Linux smaps_rollup): a page shared by several processes, such as a GGUF file that "
             "peers map read-only, counts once between them. Sampled once a second.")
    return ResultsPage(f"memory-{name}", f"Peak memory: {name}", about, (table,), output=output)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--write-docs", metavar="NAME", help="also write docs/results/memory-NAME.md")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    if args.write_docs is not None and (not args.write_docs or "/" in args.write_docs):
        parser.error(f"--write-docs takes a bare page name such as qwen1.5b-cluster, got {args.write_docs!r}")
    if not (PROC / "self" / "smaps_rollup").exists():
        sys.exit("this needs Linux /proc/PID/smaps_rollup")
    started = time.monotonic()
    kept: collections.deque = collections.deque(maxlen=OUTPUT_LINES_KEPT)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    echo = threading.Thread(target=echo_and_keep, args=(process.stdout, kept), daemon=True)
    echo.start()
    peak, commands = Sample(0.0, {}), {}
    while process.poll() is None:
        pss = {pid: kib for pid in process_tree(process.pid) if (kib := pss_kib(pid)) is not None}
        sample = Sample(time.monotonic() - started, pss)
        if sample.total_kib > peak.total_kib:
            peak = sample
            commands = {pid: command_line(pid) for pid in pss}
        try:
            process.wait(timeout=args.interval)
        except subprocess.TimeoutExpired:
            pass
    echo.join(timeout=10)  # the command's last lines come before the summary (a child may keep the pipe open)
    print(f"\npeak PSS of the process tree: {peak.total_kib / 2**20:.2f} GiB at {peak.at_s:.0f} s "
          f"({len(peak.pss_kib)} processes); exit status {process.returncode}")
    for pid, kib in sorted(peak.pss_kib.items(), key=lambda item: -item[1]):
        print(f"  {kib / 2**20:6.2f} GiB  {pid:>7}  {commands.get(pid, '?')[:110]}")
    if args.write_docs:
        from nebula_engine.bench.results_page import write_page

        page = memory_page(args.write_docs, peak, commands, process.returncode, "".join(kept))
        print(f"wrote {write_page(page)}")
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory of a command and every process it starts: the sum of their PSS (proportional set size), sampled.

PSS splits each shared page among the processes that map it, so peers that map one GGUF file read-only count it
once between them, and the sum is what the machine gives the whole process tree (Linux ``/proc/PID/smaps_rollup``).

    python tools/peak_memory.py -- nebula-engine compare --model qwen2.5-coder-1.5b --policy nebula \\
        --num-requests 8 --max-prompt-tokens 2048

Prints the peak of the sum, the processes at that moment with their PSS, and the command's exit status (which it
exits with). Standard library only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
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
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    if not (PROC / "self" / "smaps_rollup").exists():
        sys.exit("this needs Linux /proc/PID/smaps_rollup")
    started = time.monotonic()
    process = subprocess.Popen(command)
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
    print(f"\npeak PSS of the process tree: {peak.total_kib / 2**20:.2f} GiB at {peak.at_s:.0f} s "
          f"({len(peak.pss_kib)} processes); exit status {process.returncode}")
    for pid, kib in sorted(peak.pss_kib.items(), key=lambda item: -item[1]):
        print(f"  {kib / 2**20:6.2f} GiB  {pid:>7}  {commands.get(pid, '?')[:110]}")
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())

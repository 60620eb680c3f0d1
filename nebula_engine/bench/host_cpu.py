"""How much of this machine's CPU its hypervisor gave to other guests (steal time, Linux ``/proc/stat``).

A virtual machine's cores are shared with other guests; while they run, every process here is slowed alike, from
outside. A comparison that runs its sides one after another can only be read with that share of each side's
time beside it.
"""

from __future__ import annotations

from pathlib import Path

PROC_STAT = Path("/proc/stat")
STEAL_FIELD = 7  # of the "cpu" line's jiffies: user nice system idle iowait irq softirq steal ...


def cpu_jiffies(stat_file: Path = PROC_STAT) -> tuple[int, int] | None:
    """(stolen, all) jiffies of the machine's CPUs since boot; None without a readable ``/proc/stat``."""
    try:
        first = stat_file.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not first or first[0] != "cpu" or len(first) <= STEAL_FIELD + 1:
        return None
    jiffies = [int(value) for value in first[1:STEAL_FIELD + 2]]  # guest time is already inside user and nice
    return jiffies[STEAL_FIELD], sum(jiffies)


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen between two ``cpu_jiffies`` readings; None when either is missing."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])

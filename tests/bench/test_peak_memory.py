"""tools/peak_memory.py: the peak of a command's process tree, its output passed through, its exit status kept, and
the results page it writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "peak_memory.py"
# a child holding ~200 MB that its parent waits for: the tree's peak is the two together
HOLDER = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
          "'import time; b = bytearray(200_000_000); b[::4096] = b\"x\" * len(b[::4096]); print(\"held\", flush=True); "
          "time.sleep(2.5)'], check=True); print('done'); sys.exit(3)")


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc/PID/smaps_rollup")
def test_peak_of_the_tree_output_exit_status_and_page(tmp_path):
    result = subprocess.run([sys.executable, str(TOOL), "--interval", "0.2", "--write-docs", "holder", "--",
                             sys.executable, "-c", HOLDER], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    lines = result.stdout.splitlines()
    assert lines.index("held") < lines.index("done") < next(i for i, l in enumerate(lines) if l.startswith("peak PSS"))
    peak = float(next(l for l in lines if l.startswith("peak PSS")).split(": ")[1].split(" GiB")[0])
    assert 0.18 < peak < 2.0  # the child's touched 200 MB, counted while it lived
    page = (tmp_path / "docs" / "results" / "memory-holder.md").read_text()
    assert "# Peak memory: holder" in page and "exited with status 3" in page and "done" in page


def test_a_page_name_with_a_path_is_refused(tmp_path):
    result = subprocess.run([sys.executable, str(TOOL), "--write-docs", "../x", "--", "true"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "bare page name" in result.stderr

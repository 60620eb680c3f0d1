"""The security probe's short run (``tools/security_probe.py --short``): nothing it sends gets through."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[2] / "tools" / "security_probe.py"


def load_probe():
    spec = importlib.util.spec_from_file_location("security_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_short_probe_finds_nothing_getting_through(qwen3_dir, tmp_path):
    probe = load_probe()
    rows = probe.run(str(qwen3_dir), short=True, workdir=tmp_path)
    assert {row.area for row in rows} == {"input", "auth", "greedy", "slow", "frames", "disk tier"}
    assert [row for row in rows if not row.passed] == [], probe.format_table(rows)
    assert all(row.sent > 0 for row in rows)

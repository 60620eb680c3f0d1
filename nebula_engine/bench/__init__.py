"""Benchmark clients: trace replay against an OpenAI-compatible server (TTFT, CHR, goodput).

Import from the modules (``bench.replay``, ``bench.report``): this package imports nothing, so the commands that
use it (``cli/bench.py``, ``cli/profile.py``) list their help without the bench extra (aiohttp, matplotlib).
"""

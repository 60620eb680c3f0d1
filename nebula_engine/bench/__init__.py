"""Benchmark clients: trace replay against an OpenAI-compatible server (TTFT, CHR, goodput).

Import from the modules (``bench.replay``, ``bench.report``): this package imports nothing, so its commands load
without the bench extra (aiohttp, matplotlib).
"""

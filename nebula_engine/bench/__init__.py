"""Benchmark clients: trace replay against an OpenAI-compatible server (TTFT, CHR, goodput)."""

from nebula_engine.bench.replay import BenchError, ReplayOptions, ReplayResult, RequestRecord, replay
from nebula_engine.bench.report import summarize, write_report

__all__ = ["BenchError", "ReplayOptions", "ReplayResult", "RequestRecord", "replay", "summarize", "write_report"]

"""Workloads: trace loaders and generators producing `Request`s, and the paper's reuse analysis."""

from nebula_engine.workloads.analysis import (
    Distribution, ReuseStats, SegmentStats, logged_size_ratio, reuse_stats, segment_stats,
)
from nebula_engine.workloads.registry import WORKLOADS, load_workload, resolve_source
from nebula_engine.workloads.request import Request, Segment, SegmentKind
from nebula_engine.workloads.segments import LoadOptions, Tokenizer

__all__ = [
    "WORKLOADS", "Distribution", "LoadOptions", "Request", "ReuseStats", "Segment", "SegmentKind",
    "SegmentStats", "Tokenizer", "load_workload", "logged_size_ratio", "resolve_source", "reuse_stats",
    "segment_stats",
]

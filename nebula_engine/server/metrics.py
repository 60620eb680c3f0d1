"""Prometheus metrics of one API server, in a registry of its own (several apps can live in one process).

Request-level series (TTFT, prompt / cached / generated tokens, outcomes) are recorded by the API from each
request's outputs, so they mean the same whatever ``EngineClient`` serves them. Queue gauges are read from
``EngineClient.stats()`` at scrape time. The cluster adds its own series (transfer bytes, evictions, ...)
with ``ServerMetrics.register(collector)``.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nebula_engine.engine.async_engine import EngineStats
from nebula_engine.engine.outputs import RequestOutput

# 5 ms .. 60 s: tiny CPU models answer in milliseconds, long RAG prompts on big models take seconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0)
REQUEST_STATUSES = ("ok", "invalid", "error", "aborted")  # aborted: the client went away before the end


class _QueueCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        yield GaugeMetricFamily("nebula_requests_waiting", "Requests queued, not yet scheduled.",
                                value=stats.num_waiting)
        yield GaugeMetricFamily("nebula_requests_running", "Requests holding KV cache, prefilling or decoding.",
                                value=stats.num_running)


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter("nebula_requests", "Finished API requests by endpoint and outcome.",
                                ["endpoint", "status"], registry=registry)
        self.time_to_first_token = Histogram("nebula_time_to_first_token_seconds",
                                             "From request arrival to the first generated token.",
                                             buckets=TTFT_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("nebula_prompt_tokens", "Prompt tokens of admitted requests.", registry=registry)
        self.cached_prompt_tokens = Counter("nebula_cached_prompt_tokens",
                                            "Prompt tokens whose KV was reused, by cache kind (prefix | pic).",
                                            ["kind"], registry=registry)
        self.recomputed_prompt_tokens = Counter("nebula_recomputed_prompt_tokens",
                                                "PIC-reused prompt tokens the PIC backend recomputed.",
                                                registry=registry)
        self.generation_tokens = Counter("nebula_generation_tokens", "Generated tokens.", registry=registry)
        registry.register(_QueueCollector(stats))

    def register(self, collector: Collector) -> None:
        """Expose more series on ``/metrics`` (the cluster's transfer bytes, evictions, ...)."""
        self.registry.register(collector)

    def on_first_output(self, output: RequestOutput, seconds_since_arrival: float) -> None:
        self.time_to_first_token.observe(seconds_since_arrival)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.cached_prompt_tokens.labels("prefix").inc(output.num_prefix_cached_tokens)
        self.cached_prompt_tokens.labels("pic").inc(output.num_pic_cached_tokens)
        self.recomputed_prompt_tokens.inc(output.num_recomputed_tokens)

    def on_request_end(self, endpoint: str, status: str, last_outputs: Sequence[RequestOutput] = ()) -> None:
        """``last_outputs``: the last output of each prompt of the request (a completions batch has several)."""
        if status not in REQUEST_STATUSES:
            raise ValueError(f"request status must be one of {REQUEST_STATUSES}, got {status!r}")
        self.requests.labels(endpoint, status).inc()
        self.generation_tokens.inc(sum(len(c.token_ids) for output in last_outputs for c in output.outputs))

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of a scrape."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

"""Prometheus metrics of one API server, in a registry of its own (several apps can live in one process).

Request-level series are recorded by the API from each request's outputs as they arrive (``ServerMetrics.timed``),
so they mean the same whatever ``EngineClient`` serves them. Queue and prefill time are the engine's own stamps
(``RequestOutput.times``: arrival in the engine -> first scheduled -> first token), observed where the engine
reports them; decode time runs from the first output to the last as the API sees them. Queue gauges and KV-cache
usage are read from ``EngineClient.stats()`` at scrape time. The cluster adds its own series (transfer bytes,
evictions, ...) with ``ServerMetrics.register``.

The ``nebula:`` series carry vLLM's names and meanings (``vllm:time_to_first_token_seconds`` ->
``nebula:time_to_first_token_seconds``, ...) and a ``model_name`` label, so a vLLM dashboard charts them with the
prefix changed; PIC adds its own (``nebula:pic_*``, and ``nebula:kv_tier_hit_tokens``: reused KV found on the host or
disk tier). A cluster peer adds what it read from other peers (``nebula:kv_remote_read_*``, ``cluster.runtime.
metrics``). The older ``nebula_*`` series stay for existing scrapers.
"""

from __future__ import annotations

import time
from typing import AsyncIterator, Callable, Iterable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nebula_engine.engine.async_engine import EngineStats
from nebula_engine.engine.outputs import RequestOutput

# 5 ms .. 60 s: tiny CPU models answer in milliseconds, long RAG prompts on big models take seconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0)
REQUEST_STATUSES = ("ok", "invalid", "error", "aborted")  # aborted: the client went away before the end
# vLLM's buckets (vllm/v1/metrics/loggers.py): inter-token latency, end-to-end / phase times; token counts on its
# 1-2-5 series
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "error", "abort")
TIER_HIT_LABELS = tuple((kind, tier) for kind in ("prefix", "pic") for tier in ("host", "disk"))


def package_version() -> str:
    """nebula-engine's installed version (``/version``, as vLLM's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nebula-engine")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class _QueueCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self._stats = stats
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        yield GaugeMetricFamily("nebula_requests_waiting", "Requests queued, not yet scheduled.",
                                value=stats.num_waiting)
        yield GaugeMetricFamily("nebula_requests_running", "Requests holding KV cache, prefilling or decoding.",
                                value=stats.num_running)
        for name, help_text, value in (
                ("nebula:num_requests_running", "Number of requests in model execution batches.", stats.num_running),
                ("nebula:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting)):
            gauge = GaugeMetricFamily(name, help_text, labels=["model_name"])
            gauge.add_metric([self._model_name], value)
            yield gauge
        tiers = CounterMetricFamily("nebula:kv_tier_hit_tokens", "Reused tokens whose KV was found on a tier below "
                                    "the device (host memory, disk) and brought back, by kind (prefix, pic) and tier",
                                    labels=["model_name", "kind", "tier"])
        found = {(kind, tier): tokens for kind, tier, tokens in stats.tier_hit_tokens}
        for kind, tier in TIER_HIT_LABELS:
            tiers.add_metric([self._model_name, kind, tier], found.get((kind, tier), 0))
        yield tiers
        usage = GaugeMetricFamily("nebula:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=["model_name"])
        usage.add_metric([self._model_name], stats.kv_cache_usage)
        yield usage


class _RequestSeries:
    """vLLM's per-request series (``nebula:`` prefix, ``model_name`` label) and PIC's own."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        def counter(name: str, help_text: str, *labels: str) -> Counter:
            return Counter(name, help_text, ["model_name", *labels], registry=registry)

        def histogram(name: str, help_text: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, help_text, ["model_name"], buckets=buckets, registry=registry)

        self.model_name = model_name
        self.prompt_tokens = counter("nebula:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("nebula:generation_tokens", "Number of generation tokens processed.")
        self.prefix_cache_queries = counter("nebula:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("nebula:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.pic_reused = counter("nebula:pic_reused_tokens",
                                  "PIC segment tokens whose KV a combine reused at a new position.")
        self.pic_hits = counter("nebula:pic_cache_hits",
                                "PIC segment tokens whose KV existed before the request (PIC store hits).")
        self.pic_recomputed = counter("nebula:pic_recomputed_tokens",
                                      "PIC-reused tokens the PIC backend recomputed.")
        self.success = counter("nebula:request_success", "Count of finished requests by finish reason.",
                               "finished_reason")
        self.ttft = histogram("nebula:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("nebula:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("nebula:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("nebula:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_TIME_BUCKETS)
        self.queue_time = histogram("nebula:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram("nebula:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_TIME_BUCKETS)
        self.decode_time = histogram("nebula:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_TIME_BUCKETS)
        self.prompt_lengths = histogram("nebula:request_prompt_tokens", "Number of prefill tokens processed.",
                                        TOKEN_COUNT_BUCKETS)
        self.generation_lengths = histogram("nebula:request_generation_tokens",
                                            "Number of generation tokens processed.", TOKEN_COUNT_BUCKETS)

    def first(self, output: RequestOutput, ttft: float) -> None:
        label = self.model_name
        self.ttft.labels(label).observe(ttft)
        num_prompt = len(output.prompt_token_ids)
        self.prompt_tokens.labels(label).inc(num_prompt)
        self.prefix_cache_queries.labels(label).inc(num_prompt)
        self.prefix_cache_hits.labels(label).inc(output.num_prefix_cached_tokens)
        self.pic_reused.labels(label).inc(output.num_pic_cached_tokens)
        self.pic_hits.labels(label).inc(output.num_cached_tokens - output.num_prefix_cached_tokens)
        self.pic_recomputed.labels(label).inc(output.num_recomputed_tokens)
        self.prompt_lengths.labels(label).observe(num_prompt)
        if output.times is not None:
            self.queue_time.labels(label).observe(output.times.queued)
            self.prefill_time.labels(label).observe(output.times.prefill)

    def tokens(self, num_steps: int, seconds: float) -> None:
        """``num_steps`` new tokens per completion arrived ``seconds`` after the previous ones."""
        for _ in range(num_steps):
            self.itl.labels(self.model_name).observe(seconds / num_steps)

    def last(self, output: RequestOutput, e2e: float, decode: float) -> None:
        label = self.model_name
        self.e2e.labels(label).observe(e2e)
        self.decode_time.labels(label).observe(decode)
        for completion in output.outputs:
            generated = len(completion.token_ids)
            self.generation_tokens.labels(label).inc(generated)
            self.generation_lengths.labels(label).observe(generated)
            if generated > 1:
                self.tpot.labels(label).observe(decode / (generated - 1))
            self.success.labels(label, completion.finish_reason or "abort").inc()


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str = ""):
        self.registry = CollectorRegistry()
        registry = self.registry
        self.series = _RequestSeries(registry, model_name)
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
        registry.register(_QueueCollector(stats, model_name))

    async def timed(self, stream: AsyncIterator[RequestOutput], arrival: float) -> AsyncIterator[RequestOutput]:
        """``stream`` unchanged, its outputs recorded as they arrive: the first (TTFT, prompt and cache tokens),
        each next one (inter-token latency), the last (end-to-end and decode time, lengths, finish reasons).
        ``arrival``: ``time.perf_counter()`` when the request came in. Closing it closes ``stream``."""
        first_time = previous_time = None
        previous_steps = 0
        try:
            async for output in stream:
                now = time.perf_counter()
                steps = max((len(c.token_ids) for c in output.outputs), default=0)
                if first_time is None:
                    first_time = now
                    self.series.first(output, now - arrival)
                elif steps > previous_steps:
                    self.series.tokens(steps - previous_steps, now - previous_time)
                previous_time, previous_steps = now, steps
                if output.finished:
                    self.series.last(output, now - arrival, now - first_time)
                yield output
        finally:
            await stream.aclose()

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

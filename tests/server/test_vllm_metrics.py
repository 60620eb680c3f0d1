"""``/metrics`` as a vLLM dashboard reads it (``nebula:`` series with vLLM's names and a ``model_name`` label),
the Grafana dashboard in ``docs/grafana`` charting only series the server exposes, and ``/version``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_NAME, openai_client, serve_for_openai_clients

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "nebula-engine.json"
PROMPT = "one two three four five six seven eight nine ten eleven twelve"


@pytest.fixture(scope="module")
def server(observed_engine):
    yield from serve_for_openai_clients(observed_engine)


def samples(server) -> dict[tuple[str, tuple], float]:
    text = httpx2.get(f"{server.url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(snapshot, name: str, **labels) -> float:
    return snapshot.get((name, tuple(sorted({"model_name": MODEL_NAME, **labels}.items()))), 0.0)


def test_request_series_count_what_the_requests_did(server):
    client = openai_client(server)
    before = samples(server)
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    after = samples(server)

    def grew(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                      "request_decode_time"):
        assert grew(f"nebula:{histogram}_seconds_count") == 2, histogram
        assert grew(f"nebula:{histogram}_seconds_sum") >= 0, histogram
    # the engine's phases fit inside what the API measured: queue + prefill before the first token, each >= 0
    assert (grew("nebula:request_queue_time_seconds_sum") + grew("nebula:request_prefill_time_seconds_sum")
            <= grew("nebula:time_to_first_token_seconds_sum"))
    assert grew("nebula:request_prompt_tokens_count") == 2
    assert grew("nebula:request_prompt_tokens_sum") == 2 * whole.usage.prompt_tokens
    assert grew("nebula:request_generation_tokens_count") == 2
    assert grew("nebula:inter_token_latency_seconds_count") == (5 - 1) + (4 - 1)
    assert grew("nebula:request_time_per_output_token_seconds_count") == 2
    assert grew("nebula:request_success_total", finished_reason="length") == 2
    assert grew("nebula:prompt_tokens_total") == 2 * whole.usage.prompt_tokens
    assert grew("nebula:generation_tokens_total") == 5 + 4
    assert grew("nebula:request_generation_tokens_sum") == 5 + 4
    assert grew("nebula:prefix_cache_queries_total") == 2 * whole.usage.prompt_tokens
    # the second request found the first one's full pages in the prefix cache
    assert grew("nebula:prefix_cache_hits_total") > 0
    assert value(after, "nebula:num_requests_running") == 0 and streamed[-1].choices[0].finish_reason == "length"
    assert ("nebula:num_requests_waiting", (("model_name", MODEL_NAME),)) in after
    assert value(after, "nebula:kv_cache_usage_perc") == 0.0  # idle: cached pages nobody holds count as free
    assert grew("nebula:pic_reused_tokens_total") == 0 and grew("nebula:pic_recomputed_tokens_total") == 0


def test_pic_series_count_a_reused_segment(server):
    client = openai_client(server)
    document = "<pic>" + " ".join(f"fact {i} is true." for i in range(12)) + "</pic>"
    first = client.completions.create(model=MODEL_NAME, prompt=f"A. {document} Q?", max_tokens=1, temperature=0)
    before = samples(server)
    client.completions.create(model=MODEL_NAME, prompt=f"Other text here. {document} Q?", max_tokens=1,
                              temperature=0)
    after = samples(server)
    reused = value(after, "nebula:pic_reused_tokens_total") - value(before, "nebula:pic_reused_tokens_total")
    hits = value(after, "nebula:pic_cache_hits_total") - value(before, "nebula:pic_cache_hits_total")
    assert 0 < hits <= reused < first.usage.prompt_tokens
    assert value(after, "nebula:pic_recomputed_tokens_total") >= value(before, "nebula:pic_recomputed_tokens_total")


def test_kv_cache_usage_is_read_at_scrape_time():
    from nebula_engine.engine.async_engine import EngineStats
    from nebula_engine.server.metrics import ServerMetrics

    stats = EngineStats(num_waiting=3, num_running=2, kv_cache_usage=0.25)
    metrics = ServerMetrics(lambda: stats, MODEL_NAME)
    text = metrics.render()[0].decode()
    snapshot = {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}
    assert value(snapshot, "nebula:kv_cache_usage_perc") == 0.25
    assert (value(snapshot, "nebula:num_requests_waiting"), value(snapshot, "nebula:num_requests_running")) == (3, 2)
    assert value(snapshot, "nebula:kv_tier_hit_tokens_total", kind="pic", tier="disk") == 0  # charted before a hit
    stats = EngineStats(num_waiting=0, num_running=1, kv_cache_usage=0.5,
                        tier_hit_tokens=(("prefix", "host", 32), ("pic", "disk", 7)))
    text = metrics.render()[0].decode()
    assert "nebula:kv_cache_usage_perc{model_name=\"tiny-qwen3\"} 0.5" in text
    snapshot = {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}
    assert value(snapshot, "nebula:kv_tier_hit_tokens_total", kind="prefix", tier="host") == 32
    assert value(snapshot, "nebula:kv_tier_hit_tokens_total", kind="pic", tier="disk") == 7


def test_tier_hits_are_what_the_cache_store_brought_back_from_its_tiers(tmp_path):
    """A segment evicted to the disk tier and found there again counts as a PIC disk hit on ``EngineStats``."""
    from nebula_engine.engine.async_engine import tier_hits
    from nebula_engine.kvcache.events import CacheKind, EventLog, Tier
    from nebula_engine.kvcache.tiers import TierChain, TierConfig

    chain = TierChain(TierConfig(disk_capacity_tokens=16, disk_path=str(tmp_path)), EventLog(0))
    chain.demote(CacheKind.PIC, "segment", 9, {"pages": []})
    chain.flush()
    assert chain.promote(CacheKind.PIC, "segment") is not None
    assert tier_hits(chain.promoted_tokens) == (("pic", "disk", 9),)
    assert tier_hits({(CacheKind.PC, Tier.HOST): 16}) == (("prefix", "host", 16),)
    chain.close()


def test_the_grafana_dashboard_charts_only_series_the_server_exposes(server):
    # a labelled series has samples once a request recorded one (whatever ran before in this worker)
    openai_client(server).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0,
                                             extra_body={"ignore_eos": True})
    exposed = {name for name, _ in samples(server)}
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    charted = {m for e in expressions for m in re.findall(r"(nebula[:_][a-z0-9_:]+)", e)}
    # a cluster peer's collector (tests/cluster/test_cluster_e2e.py reads them there)
    cluster_only = {m for m in charted if m.startswith(("nebula_kv_transfer", "nebula:kv_remote_read"))}
    assert charted - cluster_only and charted - cluster_only <= exposed, charted - cluster_only - exposed
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Time to first token", "Inter-token latency", "Cache hit ratio: prefix / PIC / remote"} <= titles


def test_version_is_served(server):
    body = httpx2.get(f"{server.url}/version", timeout=30).json()
    assert isinstance(body["version"], str) and body["version"]

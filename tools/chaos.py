"""Chaos test of a local cluster: replay a trace while SIGKILLing peers on a schedule, and count how every
request ended.

For each scenario a fresh cluster (2 prefill + 1 decode peers, 3 Raft members) serves the RAGPulse slice bundled in
the package (or ``--data``) at Poisson arrivals; ``--kill-at`` seconds in, the scenario's victims are SIGKILLed:

- ``none``: nobody (the baseline: latencies on this machine without a failure);
- ``prefill``: a prefill peer that is not the leader;
- ``decode``: the decode peer;
- ``leader``: the leader (whichever peer it is);
- ``two-of-three``: the leader and one more peer, so the survivor has no majority.

Requests go to the peers the scenario does not kill, round robin (as a load balancer that health-checks would),
streaming, greedy, ``ignore_eos``, so each must end with exactly ``--max-tokens`` tokens. Per scenario it prints:
sent; completed (stream ended with ``[DONE]`` and all its tokens); failed with an error (HTTP error or an error
event); hung (nothing ended it within ``--hang-after`` s); lost (ended without an error but short, or without
``[DONE]``: a silent loss); extra / missing tokens (in completed streams, against ``--max-tokens``).

    python tools/chaos.py [--scenarios prefill,decode,leader,two-of-three] [--num-requests 40] [--qps 2]
                          [--write-docs]

``--write-docs`` writes the results page ``docs/results/chaos.md`` (machine, command, table).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nebula_engine.bench.cluster_compare import bench_model_dir  # noqa: E402
from nebula_engine.bench.replay import PromptBuilder, poisson_offsets, prompt_scale  # noqa: E402
from nebula_engine.cluster.runtime.launcher import LocalCluster, local_spec  # noqa: E402
from nebula_engine.workloads.registry import BUNDLED_DIR, load_workload  # noqa: E402

SCENARIOS = ("none", "prefill", "decode", "leader", "two-of-three")
RESULTS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "results" / "chaos.md"
ENGINE = {"page_size": 16, "num_pages": 2048}


@dataclass
class Outcome:
    status: int | None = None
    error: str | None = None
    done: bool = False  # the stream ended with [DONE]
    finish_reason: str | None = None
    completion_tokens: int | None = None
    hung: bool = False
    latency_s: float | None = None
    response_id: str | None = None  # from the first chunk: find it in the peers' logs


def victims(scenario: str, cluster: LocalCluster) -> list[str]:
    leader = cluster.leader()
    if scenario == "none":
        return []
    if scenario == "prefill":
        return [next(p for p in ("prefill-0", "prefill-1") if p != leader)]
    if scenario == "decode":
        return ["decode-0"]
    if scenario == "leader":
        return [leader]
    return [leader, next(p for p in cluster.urls if p != leader and p != "prefill-0")]


async def run_request(session: aiohttp.ClientSession, url: str, body: dict, hang_after_s: float) -> Outcome:
    outcome, started = Outcome(), time.monotonic()
    try:
        await asyncio.wait_for(_stream(session, url, body, outcome), hang_after_s)
    except asyncio.TimeoutError:
        outcome.hung = True
    except (aiohttp.ClientError, ValueError) as error:
        outcome.error = f"{type(error).__name__}: {error}"
    outcome.latency_s = time.monotonic() - started
    return outcome


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, outcome: Outcome) -> None:
    async with session.post(url + "/v1/completions", json=body) as reply:
        outcome.status = reply.status
        if reply.status != 200:
            outcome.error = f"HTTP {reply.status}: {(await reply.text())[:160]}"
            return
        async for raw in reply.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[len(b"data:"):].strip()
            if payload == b"[DONE]":
                outcome.done = True
                return
            chunk = json.loads(payload)
            outcome.response_id = outcome.response_id or chunk.get("id")
            if "error" in chunk:
                outcome.error = chunk["error"]["message"][:160]
            for choice in chunk.get("choices") or []:
                outcome.finish_reason = choice["finish_reason"] or outcome.finish_reason
            if chunk.get("usage"):
                outcome.completion_tokens = chunk["usage"]["completion_tokens"]


async def replay_with_kills(cluster: LocalCluster, scenario: str, bodies: list[dict], options) -> dict:
    doomed = victims(scenario, cluster)
    fronts = itertools.cycle([name for name in cluster.urls if name not in doomed])
    offsets = poisson_offsets(len(bodies), options.qps, options.seed)
    start = time.monotonic()

    async def kill_later() -> float:
        await asyncio.sleep(options.kill_at)
        for name in doomed:
            cluster.processes[name].send_signal(signal.SIGKILL)
        return time.monotonic() - start

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        killer = asyncio.create_task(kill_later())
        tasks = []
        for body, offset in zip(bodies, offsets):
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            tasks.append(asyncio.create_task(run_request(session, cluster.urls[next(fronts)], body,
                                                         options.hang_after)))
        outcomes = await asyncio.gather(*tasks)
        killed_at = await killer
    for name in doomed:
        cluster.processes[name].wait(timeout=10)
    return summarize(scenario, doomed, killed_at, outcomes, options.max_tokens)


def summarize(scenario: str, doomed: list[str], killed_at: float, outcomes: list[Outcome], max_tokens: int) -> dict:
    completed = [o for o in outcomes if o.done and o.error is None and o.completion_tokens == max_tokens]
    failed = [o for o in outcomes if o.error is not None and not o.hung]
    hung = [o for o in outcomes if o.hung]
    lost = [o for o in outcomes if o not in completed and o not in failed and o not in hung]
    finished = [o for o in outcomes if o.done and o.completion_tokens is not None]
    return {"scenario": scenario, "killed": doomed, "killed_at_s": round(killed_at, 1), "sent": len(outcomes),
            "completed": len(completed), "failed_with_error": len(failed), "hung": len(hung), "lost": len(lost),
            "extra_tokens": sum(max(0, o.completion_tokens - max_tokens) for o in finished),
            "missing_tokens": sum(max(0, max_tokens - o.completion_tokens) for o in finished),
            "p50_latency_s": round(float(np.median([o.latency_s for o in completed])) if completed else 0.0, 1),
            "max_latency_s": round(max((o.latency_s for o in outcomes if not o.hung), default=0.0), 1),
            "errors": sorted({o.error for o in failed})[:4],
            "hung_ids": [o.response_id for o in hung + lost]}


def request_bodies(model: str, options) -> list[dict]:
    requests = load_workload("ragpulse", data_dir=options.data, limit=options.num_requests,
                             seed=options.seed)[:options.num_requests]
    builder = PromptBuilder(options.vocab_size, prompt_scale(requests, options.max_prompt_tokens),
                            options.max_prompt_tokens)
    bodies = []
    for request in requests:
        segments = builder.segments(request)
        bodies.append({"model": model, "prompt": [t for s in segments for t in s["token_ids"]],
                       "segments": segments, "max_tokens": options.max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    return bodies


def format_table(rows: list[dict]) -> str:
    columns = ("scenario", "sent", "completed", "failed_with_error", "hung", "lost", "extra_tokens",
               "missing_tokens", "p50_latency_s", "max_latency_s")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--qps", type=float, default=2.0)
    parser.add_argument("--kill-at", type=float, default=6.0, help="seconds into the replay")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--hang-after", type=float, default=120.0, help="a request not ended by then is hung")
    parser.add_argument("--data", type=Path, default=BUNDLED_DIR, help="traces directory (default: bundled slice)")
    parser.add_argument("--vocab-size", type=int, default=32_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("chaos-results"))
    parser.add_argument("--log-level", default="warning", help="of the peers (their logs go under --out)")
    parser.add_argument("--write-docs", action="store_true", help="write docs/results/chaos.md")
    options = parser.parse_args()
    scenarios = options.scenarios.split(",")
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    model = str(bench_model_dir())
    bodies = request_bodies(model, options)
    rows = []
    for scenario in scenarios:
        with LocalCluster(model, local_spec(2, 1), ENGINE, log_dir=options.out / "logs" / scenario,
                          log_level=options.log_level) as cluster:
            rows.append(asyncio.run(replay_with_kills(cluster, scenario, bodies, options)))
        print(json.dumps(rows[-1]), flush=True)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "chaos.json").write_text(json.dumps({"options": {k: str(v) for k, v in vars(options).items()},
                                                        "rows": rows}, indent=2))
    print(format_table(rows))
    if options.write_docs:
        print(f"wrote {write_results_page(rows, 'python tools/chaos.py ' + ' '.join(sys.argv[1:]))}")


def write_results_page(rows: list[dict], command: str) -> Path:
    RESULTS_PAGE.parent.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    RESULTS_PAGE.write_text(
        "# Chaos: peers killed while a trace replays\n\n"
        "How every request ended when `tools/chaos.py` SIGKILLed the scenario's peers of a 2 prefill + 1 decode "
        "local cluster mid-replay. `hung` and `lost` must be 0: a request either completes with all its tokens or "
        "ends with an error.\n\n"
        f"- machine: {machine}\n- command: `{command.strip()}`\n\n{format_table(rows)}\n")
    return RESULTS_PAGE


if __name__ == "__main__":
    main()

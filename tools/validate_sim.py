"""Validate the simulator against a real `nebula-engine compare` run on this machine.

Reads the JSON `compare` writes (its own settings: trace, request count, rate, seed, peers, prompt cap, engine
pool) and a profile measured here by `nebula-engine profile`, replays the same requests through the simulator
with the compare's cluster (its prefill peers, its pool size, first token streamed by the prefill peer), the
same prompt shrinking and the same Poisson arrival times as the replay client, and prints, per policy, the
predicted TTFT p50 beside the measured one.

    nebula-engine profile --out profile.json
    nebula-engine compare --num-requests 24 --out bench_results
    python tools/validate_sim.py --compare bench_results/compare.json --profile profile.json --write-docs

``--write-docs`` also writes the comparison to docs/results/simulator-vs-cluster.md.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

from nebula_engine.bench.replay import PromptBuilder, poisson_offsets, prompt_scale
from nebula_engine.bench.results_page import DOCS_RESULTS, ResultsPage, Table, write_page
from nebula_engine.cluster.control.config import ClusterConfig, ClusterProfile
from nebula_engine.cluster.sim.simulator import SimulationConfig, simulate
from nebula_engine.workloads import load_workload
from nebula_engine.workloads.request import Request, Segment

TOLERANCE = 0.30  # the bar the simulator is held to: predicted p50 within 30% of the measured one
VOCAB = 32_000  # token ids do not matter to the simulator, only lengths


def shrunk(requests: list[Request], max_prompt_tokens: int | None) -> list[Request]:
    """The requests as the replay client sends them: one scale for the run, prompts cut to the cap."""
    builder = PromptBuilder(VOCAB, prompt_scale(requests, max_prompt_tokens), max_prompt_tokens)
    out = []
    for request in requests:
        wire = iter(builder.segments(request))
        segments = []
        for segment in request.segments:  # the builder drops segments that shrink to nothing, in order
            if not segment.num_tokens or not (sent := next(wire, None)):
                continue
            segments.append(Segment(segment.kind, segment.content_id, len(sent["token_ids"])))
        out.append(replace(request, segments=tuple(segments)))
    return out


def simulated_rows(compare: dict, profile: ClusterProfile, data_dir: str | None) -> dict[str, dict]:
    """Each policy of the compare, simulated with its settings (first token streamed by the prefill peer)."""
    options = compare["options"]
    n = int(options["num_requests"])
    requests = load_workload(options["trace"], data_dir=data_dir, limit=n, seed=int(options["seed"]))[:n]
    requests = shrunk(requests, options.get("max_prompt_tokens"))
    offsets = tuple(poisson_offsets(len(requests), float(options["qps"]), int(options["seed"])))
    profile = replace(profile, cache_capacity_tokens=int(options["num_pages"]) * int(options["page_size"]))
    cluster = ClusterConfig(num_prefill_workers=int(options["prefill_workers"]), profile=profile,
                            seed=int(options["seed"]))
    rows = {}
    for row in compare["rows"]:
        # the runtime's workers evict by the share the router broadcasts, whatever the policy
        config = SimulationConfig(cluster=cluster, policy=row["policy"], cache="self-tuning", qps=float(options["qps"]),
                                  ttft_includes_handoff=False, arrival_offsets=offsets)
        rows[row["policy"]] = simulate(config, requests).summary()
    return rows


def table(compare: dict, predicted: dict[str, dict]) -> tuple[str, list[dict]]:
    lines = [f"{'policy':<10} {'measured p50 s':>15} {'predicted p50 s':>16} {'error':>8} {'measured CHR':>13} "
             f"{'predicted CHR':>14}  within {TOLERANCE:.0%}"]
    results = []
    for row in compare["rows"]:
        sim = predicted[row["policy"]]
        error = sim["ttft_p50_s"] / row["ttft_p50_s"] - 1
        results.append({"policy": row["policy"], "measured_p50_s": row["ttft_p50_s"], "predicted_p50_s": sim["ttft_p50_s"],
                        "error": error, "measured_chr": row["cache_hit_ratio"], "predicted_chr": sim["cache_hit_ratio"],
                        "measured_p99_s": row["ttft_p99_s"], "predicted_p99_s": sim["ttft_p99_s"]})
        lines.append(f"{row['policy']:<10} {row['ttft_p50_s']:>15.3f} {sim['ttft_p50_s']:>16.3f} {error:>+8.0%} "
                     f"{row['cache_hit_ratio']:>13.1%} {sim['cache_hit_ratio']:>14.1%}  "
                     f"{'yes' if abs(error) <= TOLERANCE else 'no'}")
    return "\n".join(lines), results


ABOUT = ("The discrete-event simulator (`nebula-engine simulate`) runs the router's own control plane over modelled "
         "workers. Here it replays the requests of a real `nebula-engine compare` run (same slice, prompt lengths and "
         "arrival times, same peers and KV pool) with a profile this machine measured (`nebula-engine profile`), and "
         "its predicted TTFT p50 stands beside the one the real cluster measured. The simulator leaves out HTTP, "
         "the router's and the peers' message hops.")


def results_page(header: str, results: list[dict]) -> ResultsPage:
    table = Table(("policy", "measured p50 s", "predicted p50 s", "error", "measured CHR", "predicted CHR",
                   f"within {TOLERANCE:.0%}"),
                  tuple((r["policy"], f"{r['measured_p50_s']:.3f}", f"{r['predicted_p50_s']:.3f}", f"{r['error']:+.0%}",
                         f"{r['measured_chr']:.1%}", f"{r['predicted_chr']:.1%}",
                         "yes" if abs(r["error"]) <= TOLERANCE else "no") for r in results),
                  caption=header)
    notes = ("error: predicted / measured - 1.",
             "CHR: prompt tokens served from KV that existed before the request, over all prompt tokens.")
    return ResultsPage("simulator-vs-cluster", "Simulator against the real cluster", ABOUT, (table,), notes)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", required=True, type=Path, help="compare.json written by nebula-engine compare")
    parser.add_argument("--profile", required=True, help="profile JSON written by nebula-engine profile")
    parser.add_argument("--data", default=None, help="traces directory (as compare's --data)")
    parser.add_argument("--out", type=Path, default=None, help="also write the comparison as JSON here")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"also write the results page {DOCS_RESULTS}/simulator-vs-cluster.md")
    parser.add_argument("--node-cores", type=float, default=None,
                        help="cores the cluster really had [default: the profile's, i.e. the machine to itself]")
    parser.add_argument("--load-average", type=float, default=None,
                        help="the machine's load average while compare ran, other work included: the cluster then gets "
                             "cores x min(1, cores / load) of the cores (each runnable thread's fair share)")
    args = parser.parse_args(argv)
    compare = json.loads(args.compare.read_text())
    profile = ClusterProfile.load(args.profile)
    if args.node_cores is not None:
        profile = replace(profile, node_cores=args.node_cores)
    if args.load_average is not None:
        profile = replace(profile, node_cores=profile.node_cores * min(1.0, profile.node_cores / args.load_average))
    options = compare["options"]
    header = (f"{options['num_requests']} {options['trace']} requests at {options['qps']} req/s, "
              f"{options['prefill_workers']} prefill + {options['decode_workers']} decode peers; "
              f"profile {profile.name} ({profile.node_cores:g} cores shared by the workers); load average now "
              f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(header)
    text, results = table(compare, simulated_rows(compare, profile, args.data))
    print(text)
    if args.write_docs:
        print(f"wrote {write_page(results_page(header, results))}")
    if args.out:
        args.out.write_text(json.dumps({"compare": str(args.compare), "profile": args.profile, "rows": results}, indent=2))
    return results


if __name__ == "__main__":
    main()

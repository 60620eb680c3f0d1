"""Reproduce the paper's headline numbers (and, on request, analogues of its figures) with the simulator.

    python tools/reproduce_paper.py --headline              # the headline table: bench_results/reproduction/results.md
    python tools/reproduce_paper.py --figures 11-13,14,15-17,10+18 --out reproduction   # plots as well
    python tools/reproduce_paper.py --headline --write-docs  # and the results page docs/results/simulator-vs-paper.md

Setup (paper §9.1): 7 prefill + 1 decode workers, each trace replayed in its original order with Poisson arrivals,
the paper's model per trace as a profile (Fig. 11's pairing: QuAC / DeepSeek-V2-Lite / CacheBlend, RAGPulse /
Qwen3.5-35B-A3B / HYPIC, tau-bench / Mistral-7B / EPIC, ChatDev / Qwen3-30B-A3B / A3), the first token after
the KV hand-off to the decode worker, each run from a cold cluster.

Rates (point 7): the paper's rate grids keep their spacing but are rescaled per trace and profile so that the
top rate offers the prefix-caching baseline exactly its simulated prefill capacity (cluster/sim/loads.py): the
paper's own baseline queues at the top of every grid (P50 TTFT 2.7-76 s against Nebula's 0.18-0.79 s).

Ablations (Figs. 14-16) run at the top rate with a device pool per worker of a quarter of the slice's distinct
tokens divided by the workers (at least twice the longest request; host tier twice the pool, SGLang's ratio), so
that both tiers evict.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

from nebula_engine.bench.results_page import DOCS_RESULTS, ResultsPage, Table, write_page
from nebula_engine.cluster.control.config import ClusterConfig, ClusterProfile
from nebula_engine.cluster.sim.loads import pc_capacity_rps, rate_grid
from nebula_engine.cluster.sim.simulator import SimulationConfig, simulate
from nebula_engine.workloads import load_workload, reuse_stats

WORKERS = 7
POLICIES = ("pc", "local-pic", "nebula")
# Fig. 11 pairing: trace -> (profile of the paper's model, the paper's rate grid)
END_TO_END = {
    "quac": ("deepseek-v2-lite", (2, 4, 6, 8, 10)),
    "ragpulse": ("qwen3.5-35b-a3b", (2, 4, 6, 8, 10)),
    "tau-bench": ("default", (10, 20, 30, 40, 50)),
    "chatdev": ("qwen3-30b-a3b", (4, 6, 8, 10, 12)),
}
VIEW_SETUPS = {w: ("qwen3.5-35b-a3b", (8, 16, 24, 32, 40)) for w in ("ragpulse", "tau-bench")}  # Figs. 6, 14
CACHE_SETUPS = {"ragpulse": ("qwen3.5-35b-a3b", (8, 16, 24, 32, 40, 48)),  # Figs. 8, 15-17
                "chatdev": ("qwen3-30b-a3b", (4, 6, 8, 10, 12))}
PAPER = {
    "p50_cut_vs_local_mean": 61.4, "p50_cut_vs_pc_mean": 76.7, "recovered_mean": 76.1,
    "recovered": {"quac": 84.7, "ragpulse": 42.1, "tau-bench": 86.3, "chatdev": 91.2},
    "nebula_chr": {"quac": 84.82, "ragpulse": 58.99, "tau-bench": 93.67, "chatdev": 93.17},
    "top_p50_s": {"quac": (0.24, 1.26, 75.73), "ragpulse": (0.79, 2.39, 2.71), "tau-bench": (0.18, 3.64, 8.79),
                  "chatdev": (0.24, 9.57, 8.46)},  # (Nebula, Local-PIC, PC) at the top rate
    "views": {"ragpulse": (18.9, 5.4, 98.4, 96.1), "tau-bench": (14.9, 19.5, 100.0, 95.1)},
    "caches": {"ragpulse": (4.32, 4.88, 11.5, 14.7), "chatdev": (5.48, 7.37, 20.8, 23.4)},
    "p_share": {"ragpulse": "falls to ~0 at the maximum rate", "chatdev": "falls, then rises"},
}


@dataclass(frozen=True)
class Run:
    workload: str
    profile: str
    qps: float
    policy: str = "nebula"
    view: str | None = None
    cache: str | None = None  # None: the policy's default (LRU for the baselines, self-tuning for Nebula)
    scheduler: str = "greedy"
    capacity: int | None = None
    update_window: int = 16
    warmup: int = 0


@lru_cache(maxsize=None)
def requests_of(workload: str, data_dir: str, limit: int):
    return load_workload(workload, data_dir=data_dir, limit=limit)[:limit]


def execute(job: tuple[Run, str, int]) -> dict:
    run, data_dir, limit = job
    profile = ClusterProfile.load(run.profile)
    if run.capacity is not None:
        profile = replace(profile, cache_capacity_tokens=run.capacity, host_capacity_tokens=2 * run.capacity)
    cluster = ClusterConfig(num_prefill_workers=WORKERS, profile=profile)
    cluster = replace(cluster, cache_manager=replace(cluster.cache_manager, update_window=run.update_window))
    config = SimulationConfig(cluster=cluster, policy=run.policy, view=run.view, cache=run.cache,
                              scheduler=run.scheduler, qps=run.qps, warmup_requests=run.warmup)
    report = simulate(config, requests_of(run.workload, data_dir, limit))
    return {"run": asdict(run), **report.summary(), "pc_share_history": list(report.pc_share_history),
            "ttfts_s": list(report.ttfts_s)}


class Reproduction:
    def __init__(self, args):
        self.args = args
        self.sections: list[str] = []
        self.tables: list = []  # the sections as results-page tables
        self.results: dict = {}

    def requests(self, workload: str):
        return requests_of(workload, self.args.data, self.args.limit)

    def rates(self, workload: str, profile: str, grid) -> list[float]:
        """The paper's grid rescaled so its top rate is the PC baseline's simulated capacity (load 1)."""
        capacity = pc_capacity_rps(self.requests(workload), ClusterProfile.load(profile), WORKERS)
        rates = [float(f"{q:.3g}") for q in rate_grid(self.args.top_load, grid, capacity)]
        return sorted(set(rates[1::2] + rates[-1:])) if self.args.quick else rates

    def pressure_capacity(self, workload: str) -> int:
        """Device tokens per worker: a quarter of the slice's distinct tokens over the workers, and at least
        twice the longest request (a pool always holds the requests it runs)."""
        requests = self.requests(workload)
        distinct = {s.content_id: s.num_tokens for r in requests for s in r.segments}
        return max(sum(distinct.values()) // (4 * WORKERS), 2 * max(r.num_tokens for r in requests))

    def run_all(self, runs: list[Run]) -> dict[Run, dict]:
        runs = list(dict.fromkeys(runs))
        jobs = [(r, self.args.data, self.args.limit) for r in runs]
        if self.args.jobs > 1:
            with ProcessPoolExecutor(self.args.jobs) as pool:
                outputs = list(pool.map(execute, jobs))
        else:
            outputs = [execute(job) for job in jobs]
        return dict(zip(runs, outputs))

    def section(self, title: str, header: list[str], rows: list[list], note: str = "") -> None:
        lines = [f"## {title}", ""] + ([note, ""] if note else [])
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
        text = "\n".join(lines) + "\n"
        self.sections.append(text)
        self.tables.append(Table(tuple(header), tuple(tuple(fmt(v) for v in row) for row in rows),
                                 caption=f"**{title}.** {note}".rstrip()))
        print(text, flush=True)

    def write(self, path: Path, preamble: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(preamble + "\n".join(self.sections))
        path.with_suffix(".json").write_text(json.dumps(self.results, indent=1))


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return "-" if value is None else str(value)


def cut(new: float, old: float) -> float:
    """Reduction of ``new`` against ``old``, in percent."""
    return 100.0 * (1 - new / old) if old else float("nan")


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def recovered(nebula_chr: float, pc_chr: float) -> float:
    """Prefix-missed tokens Nebula recovers: (CHR_nebula - CHR_pc) / (1 - CHR_pc), in percent (§9.2)."""
    return 100.0 * (nebula_chr - pc_chr) / (1 - pc_chr) if pc_chr < 1 else float("nan")


# ---- the headline --------------------------------------------------------------------------------------
def headline(rep: Reproduction) -> None:
    end_to_end_headline(rep)
    ablations_headline(rep)


def end_to_end_headline(rep: Reproduction) -> None:
    grids = {w: rep.rates(w, prof, grid) for w, (prof, grid) in END_TO_END.items()}
    runs = {(w, q, p): Run(w, END_TO_END[w][0], q, policy=p) for w, grid in grids.items() for q in grid for p in POLICIES}
    res = rep.run_all(list(runs.values()))
    out = {key: res[run] for key, run in runs.items()}
    rep.results["end_to_end"] = [v | {"ttfts_s": None} for v in out.values()]
    rows, cuts_local, cuts_pc, recoveries = [], [], [], []
    for w, grid in grids.items():
        local = [cut(out[(w, q, "nebula")]["ttft_p50_s"], out[(w, q, "local-pic")]["ttft_p50_s"]) for q in grid]
        pc = [cut(out[(w, q, "nebula")]["ttft_p50_s"], out[(w, q, "pc")]["ttft_p50_s"]) for q in grid]
        top = {p: out[(w, grid[-1], p)] for p in POLICIES}
        rec = recovered(top["nebula"]["cache_hit_ratio"], top["pc"]["cache_hit_ratio"])
        cuts_local += local
        cuts_pc += pc
        recoveries.append(rec)
        bound = reuse_stats(rep.requests(w)).pic
        paper_p50 = PAPER["top_p50_s"][w]
        rows.append([w, END_TO_END[w][0], " / ".join(fmt(q) for q in grid), mean(local), mean(pc), rec,
                     PAPER["recovered"][w], 100 * top["nebula"]["cache_hit_ratio"], PAPER["nebula_chr"][w],
                     100 * top["local-pic"]["cache_hit_ratio"], 100 * top["pc"]["cache_hit_ratio"], bound,
                     " / ".join(fmt(top[p]["ttft_p50_s"]) for p in ("nebula", "local-pic", "pc")),
                     " / ".join(fmt(v) for v in paper_p50)])
    rows.append(["mean", "", "", mean(cuts_local), mean(cuts_pc), mean(recoveries), PAPER["recovered_mean"], "", "", "",
                 "", "", "", ""])
    rep.results["headline"] = {"p50_cut_vs_local_mean": mean(cuts_local), "p50_cut_vs_pc_mean": mean(cuts_pc),
                               "recovered_mean": mean(recoveries), "rows": rows}
    rep.section(
        "Headline: Nebula against the baselines", [
            "trace", "profile", "rates req/s (top = PC capacity)", "P50 cut vs Local-PIC % (mean over rates)",
            "P50 cut vs PC %", "recovered PC misses % (top rate)", "paper", "Nebula CHR % (top)", "paper",
            "Local-PIC CHR %", "PC CHR %", "PIC bound %", "P50 s Nebula / Local-PIC / PC (top)", "paper"], rows,
        note=(f"Median TTFT reduction averaged over every trace and rate: **{mean(cuts_local):.1f}%** against "
              f"Local-PIC (paper {PAPER['p50_cut_vs_local_mean']}%), **{mean(cuts_pc):.1f}%** against PC (paper "
              f"{PAPER['p50_cut_vs_pc_mean']}%). Prefix-missed tokens recovered, mean over traces: "
              f"**{mean(recoveries):.1f}%** (paper {PAPER['recovered_mean']}%). The paper gives these averages, "
              "the recovery and the CHR per trace, and the P50s at its top rate; not the per-trace cuts."))


def ablations_headline(rep: Reproduction) -> None:
    view_runs = {}
    for w, (prof, grid) in VIEW_SETUPS.items():
        top, cap = rep.rates(w, prof, grid)[-1], rep.pressure_capacity(w)
        view_runs.update({(w, v): Run(w, prof, top, view=v, capacity=cap) for v in ("optimistic", "event", "nebula")})
    cache_runs = {}
    for w, (prof, grid) in CACHE_SETUPS.items():
        top, cap = rep.rates(w, prof, grid)[-1], rep.pressure_capacity(w)
        warmup = min(800, rep.args.limit // 2)  # §9.4: the first 800 requests warm the cache
        cache_runs.update({(w, c): Run(w, prof, top, cache=c, capacity=cap, warmup=warmup)
                           for c in ("self-tuning", "unified-lru", "fixed-partition")})
    res = rep.run_all(list(view_runs.values()) + list(cache_runs.values()))
    views = {k: res[r] for k, r in view_runs.items()}
    caches = {k: res[r] for k, r in cache_runs.items()}
    rep.results["ablations"] = [v | {"ttfts_s": None} for v in (*views.values(), *caches.values())]
    views_table(rep, views, view_runs)
    caches_table(rep, caches, cache_runs)


def views_table(rep: Reproduction, views: dict, runs: dict) -> None:
    rows = []
    for w in VIEW_SETUPS:
        opt, event, neb = (views[(w, v)] for v in ("optimistic", "event", "nebula"))
        paper = PAPER["views"][w]
        rows.append([w, runs[(w, "nebula")].qps, runs[(w, "nebula")].capacity,
                     cut(neb["ttft_p50_s"], opt["ttft_p50_s"]), paper[0], cut(neb["ttft_p50_s"], event["ttft_p50_s"]),
                     paper[1], f"{opt['invalid_hit_tokens']} -> {neb['invalid_hit_tokens']}",
                     cut(neb["invalid_hit_tokens"], opt["invalid_hit_tokens"]), paper[2],
                     f"{event['repeated_tokens']} -> {neb['repeated_tokens']}",
                     cut(neb["repeated_tokens"], event["repeated_tokens"]), paper[3]])
    rep.section("Fig. 14: view synchronisation (Qwen3.5 profile, top rate, eviction on)", [
        "trace", "req/s", "device tokens/worker", "P50 cut vs optimistic %", "paper", "P50 cut vs event %", "paper",
        "invalid hit tokens optimistic -> Nebula", "cut %", "paper", "repeated tokens event -> Nebula", "cut %",
        "paper"], rows)


def caches_table(rep: Reproduction, caches: dict, runs: dict) -> None:
    rows = []
    for w in CACHE_SETUPS:
        st, lru, fixed = (caches[(w, c)] for c in ("self-tuning", "unified-lru", "fixed-partition"))
        paper = PAPER["caches"][w]
        history = st["pc_share_history"]
        rows.append([w, runs[(w, "self-tuning")].qps, runs[(w, "self-tuning")].capacity,
                     100 * (st["cache_hit_ratio"] - lru["cache_hit_ratio"]), paper[0],
                     100 * (st["cache_hit_ratio"] - fixed["cache_hit_ratio"]), paper[1],
                     cut(st["ttft_p50_s"], lru["ttft_p50_s"]), paper[2], cut(st["ttft_p50_s"], fixed["ttft_p50_s"]),
                     paper[3], f"{min(history):.2f} / {history[-1]:.2f}", PAPER["p_share"][w]])
    rep.section("Figs. 15-16: cache management (top rate, eviction on, warm-up excluded)", [
        "trace", "req/s", "device tokens/worker", "CHR gain vs unified LRU pp", "paper", "CHR gain vs fixed partition pp",
        "paper", "P50 cut vs unified LRU %", "paper", "P50 cut vs fixed %", "paper", "device p: lowest / final (U=16)",
        "paper (Fig. 16)"], rows)


def preamble(args) -> str:
    return ("# Nebula reproduction (simulator)\n\n"
            f"`python tools/reproduce_paper.py --headline --limit {args.limit}`: {setup(args)}")


def setup(args) -> str:
    return (
        f"{args.limit} requests per run (trace order, "
        f"Poisson arrivals), {WORKERS} prefill + 1 decode workers, first token after the hand-off to the decode worker. "
        "Profiles: `nebula_engine/cluster/control/profiles/` (throughput from public model and H20 specs; combine cost per "
        "PIC backend measured, `tools/combine_costs.py`). Rates: the paper's grid per trace, rescaled so its top rate "
        f"offers the prefix-caching baseline {args.top_load:g} x its simulated prefill capacity "
        "(`nebula_engine/cluster/sim/loads.py`). 'paper' columns quote the paper's text; '-' where it gives none.\n\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--headline", action="store_true", help="the headline table (the default)")
    parser.add_argument("--out", default="bench_results/reproduction", help="where results.md / .json (and plots) go")
    parser.add_argument("--data", default="../shared/traces", help="traces directory")
    parser.add_argument("--limit", type=int, default=1500, help="requests per run")
    parser.add_argument("--jobs", type=int, default=2, help="parallel simulator processes")
    parser.add_argument("--top-load", type=float, default=1.0,
                        help="load at the top of each rate grid, x the PC baseline's prefill capacity")
    parser.add_argument("--figures", default="", help="also plot figure analogues: comma-separated subset of "
                                                       "11-13, 14, 15-17, 10+18 (tools/paper_figures.py)")
    parser.add_argument("--quick", action="store_true", help="300 requests and three rates per grid")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"also write the results page {DOCS_RESULTS}/simulator-vs-paper.md")
    args = parser.parse_args()
    if args.quick:
        args.limit = min(args.limit, 300)
    rep, start = Reproduction(args), time.time()
    if args.headline or not args.figures:
        headline(rep)
    if args.figures:
        from paper_figures import plot_figures

        plot_figures(rep, args.figures.split(","))
    rep.write(Path(args.out) / "results.md", preamble(args))
    print(f"wrote {Path(args.out) / 'results.md'} in {time.time() - start:.0f} s")
    if args.write_docs and rep.tables:
        page = ResultsPage("simulator-vs-paper", "Simulator against the paper",
                           "The paper's experiments replayed in the discrete-event simulator, which runs the router's "
                           "own control plane (view, cache manager, Algorithm 1) over modelled workers: " + setup(args).strip(),
                           tuple(rep.tables))
        print(f"wrote {write_page(page)}")


if __name__ == "__main__":
    main()

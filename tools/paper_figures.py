"""Plots of the simulator's analogues of the paper's figures, for tools/reproduce_paper.py --figures.

Same setup and rate rule as the headline (see reproduce_paper.py); each figure adds its table to results.md and
a PNG beside it. "Traffic" is the paper's NIXL TX payload: KV moved between prefill workers plus the hand-off to
the decode worker.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from reproduce_paper import (CACHE_SETUPS, END_TO_END, POLICIES, VIEW_SETUPS, Reproduction, Run,  # noqa: E402
                             cut)

LABEL = {"pc": "SGLang + Dynamo (pc)", "local-pic": "Local-PIC + Dynamo", "nebula": "Nebula"}
GIB = 2**30


def save(fig, rep: Reproduction, name: str) -> None:
    fig.tight_layout()
    fig.savefig(Path(rep.args.out) / name, dpi=110)
    plt.close(fig)


def end_to_end(rep: Reproduction) -> None:
    """Figs. 11 (P50 vs rate), 12 (CHR vs rate), 13 (TTFT CDF at the middle rate)."""
    grids = {w: rep.rates(w, prof, grid) for w, (prof, grid) in END_TO_END.items()}
    runs = {(w, q, p): Run(w, END_TO_END[w][0], q, policy=p) for w, g in grids.items() for q in g for p in POLICIES}
    res = rep.run_all(list(runs.values()))
    figures = [plt.subplots(1, 4, figsize=(16, 3.6)) for _ in range(3)]
    for i, (w, grid) in enumerate(grids.items()):
        (_, p50_axes), (_, chr_axes), (_, cdf_axes) = figures
        middle = grid[len(grid) // 2]
        for p in POLICIES:
            points = [res[runs[(w, q, p)]] for q in grid]
            p50_axes[i].plot(grid, [r["ttft_p50_s"] for r in points], "o-", label=LABEL[p])
            chr_axes[i].plot(grid, [100 * r["cache_hit_ratio"] for r in points], "o-", label=LABEL[p])
            ttfts = sorted(res[runs[(w, middle, p)]]["ttfts_s"])
            cdf_axes[i].plot(ttfts, [(k + 1) / len(ttfts) for k in range(len(ttfts))], label=LABEL[p])
        p50_axes[i].set(title=f"{w} / {END_TO_END[w][0]}", xlabel="req/s", ylabel="P50 TTFT (s)")
        chr_axes[i].set(title=w, xlabel="req/s", ylabel="CHR (%)")
        cdf_axes[i].set(title=f"{w} at {middle:g} req/s", xlabel="TTFT (s)", ylabel="CDF", xscale="log")
    for (fig, axes), name in zip(figures, ("fig11_ttft_vs_rate.png", "fig12_chr_vs_rate.png", "fig13_ttft_cdf.png")):
        axes[0].legend(fontsize=7)
        save(fig, rep, name)


def views(rep: Reproduction) -> None:
    """Fig. 14: P50 and invalid-hit vs repeated tokens per view variant, across rates, eviction on."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for i, (w, (prof, grid)) in enumerate(VIEW_SETUPS.items()):
        rates, cap = rep.rates(w, prof, grid), rep.pressure_capacity(w)
        runs = {(q, v): Run(w, prof, q, view=v, capacity=cap) for q in rates for v in ("optimistic", "event", "nebula")}
        res = rep.run_all(list(runs.values()))
        for v in ("optimistic", "event", "nebula"):
            points = [res[runs[(q, v)]] for q in rates]
            axes[i][0].plot(rates, [r["ttft_p50_s"] for r in points], "o-", label=v)
            axes[i][1].plot([r["invalid_hit_tokens"] / 1e3 for r in points], [r["repeated_tokens"] / 1e3 for r in points],
                            "o-", label=v)
        axes[i][0].set(title=f"{w}: P50 TTFT", xlabel="req/s", ylabel="s")
        axes[i][1].set(title=f"{w}: invalid hits vs repeated", xlabel="invalid hit tokens (k)", ylabel="repeated (k)")
    axes[0][0].legend()
    save(fig, rep, "fig14_views.png")


def caches(rep: Reproduction) -> None:
    """Figs. 15 (CHR and P50 per cache policy across rates) and 16 (the device share p at the top rate)."""
    fig15, axes15 = plt.subplots(2, 2, figsize=(11, 7))
    fig16, axes16 = plt.subplots(1, 2, figsize=(11, 3.6))
    for i, (w, (prof, grid)) in enumerate(CACHE_SETUPS.items()):
        rates, cap, warmup = rep.rates(w, prof, grid), rep.pressure_capacity(w), min(800, rep.args.limit // 2)
        names = ("self-tuning", "unified-lru", "fixed-partition")
        runs = {(q, c): Run(w, prof, q, cache=c, capacity=cap, warmup=warmup) for q in rates for c in names}
        windows = {u: Run(w, prof, rates[-1], capacity=cap, update_window=u) for u in (8, 16, 32, 64)}
        res = rep.run_all(list(runs.values()) + list(windows.values()))
        for c in names:
            points = [res[runs[(q, c)]] for q in rates]
            axes15[i][0].plot(rates, [r["ttft_p50_s"] for r in points], "o-", label=c)
            axes15[i][1].plot(rates, [100 * r["cache_hit_ratio"] for r in points], "o-", label=c)
        for u, run in windows.items():
            history = res[run]["pc_share_history"]
            axes16[i].plot([k * u for k in range(len(history))], history, label=f"U={u}")
        axes15[i][0].set(title=f"{w}: P50 TTFT", xlabel="req/s", ylabel="s")
        axes15[i][1].set(title=f"{w}: CHR", xlabel="req/s", ylabel="%")
        axes16[i].set(title=f"{w} at {rates[-1]:g} req/s", xlabel="feedback requests", ylabel="device PC share p")
    axes15[0][0].legend()
    axes16[0].legend()
    save(fig15, rep, "fig15_cache_policies.png")
    save(fig16, rep, "fig16_pc_share.png")


def schedulers(rep: Reproduction) -> None:
    """Figs. 10 and 18: traffic (incl. the hand-off) and compute CV per scheduler; P50 cuts at the top rate."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    rows = []
    for i, (w, (prof, grid)) in enumerate(VIEW_SETUPS.items()):
        rates = rep.rates(w, prof, grid)
        runs = {(q, s): Run(w, prof, q, scheduler=s) for q in rates for s in ("locality", "load", "greedy")}
        res = rep.run_all(list(runs.values()))
        for s in ("locality", "load", "greedy"):
            points = [res[runs[(q, s)]] for q in rates]
            axes[i][0].plot(rates, [r["ttft_p50_s"] for r in points], "o-", label=s)
            axes[i][1].plot([max(r["compute_cv"], 1e-3) for r in points],
                            [(r["transferred_bytes"] + r["handoff_bytes"]) / GIB for r in points], "o-", label=s)
        top = {s: res[runs[(rates[-1], s)]] for s in ("locality", "load", "greedy")}
        low = {s: res[runs[(rates[0], s)]] for s in ("locality", "load")}
        traffic = {s: (r["transferred_bytes"] + r["handoff_bytes"]) / GIB for s, r in low.items()}
        rows.append([w, rates[0], traffic["locality"], traffic["load"], low["locality"]["compute_cv"],
                     low["load"]["compute_cv"], rates[-1], cut(top["greedy"]["ttft_p50_s"], top["locality"]["ttft_p50_s"]),
                     cut(top["greedy"]["ttft_p50_s"], top["load"]["ttft_p50_s"])])
        axes[i][0].set(title=f"{w}: P50 TTFT", xlabel="req/s", ylabel="s")
        axes[i][1].set(title=f"{w}: traffic vs compute CV", xlabel="compute CV", ylabel="GiB", xscale="log")
    axes[0][0].legend()
    save(fig, rep, "fig10_fig18_schedulers.png")
    rep.section("Figs. 10 and 18: prefill schedulers (traffic = prefill-to-prefill + hand-off)", [
        "trace", "low req/s", "locality GiB", "load GiB", "locality CV", "load CV", "top req/s", "P50 cut vs locality %",
        "P50 cut vs load %"], rows,
        note="Paper, Fig. 10 at its lowest rate: RAGPulse 481.51 / 3071.37 GiB, CV 1.595 / 0.346; tau-bench 573.71 / "
             "3363.23 GiB, CV 1.586 / 0.797. Fig. 18 at its top rate: P50 cut vs locality 21.4 / 48.9 %, vs load "
             "21.4 / 19.8 %.")


FIGURES = {"11-13": end_to_end, "14": views, "15-17": caches, "10+18": schedulers}


def plot_figures(rep: Reproduction, names: list[str]) -> None:
    Path(rep.args.out).mkdir(parents=True, exist_ok=True)
    for name in names:
        if name not in FIGURES:
            raise SystemExit(f"unknown figure {name!r}; choose from {', '.join(FIGURES)}")
        FIGURES[name](rep)

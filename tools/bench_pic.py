"""Combine-prefill time of each PIC backend vs full prefill of the same prompt (warm PIC store, CPU).

The prompt is BOS (if the tokenizer has one) + --num-segments cached segments of --segment-len tokens + a
--query-len-token query; the segments were cached alone in another order, so each is re-rotated. Only
``backend.combine`` is timed (median of --repeats after one warm-up; backends alternate within each
repetition so load from other processes hits all of them alike); the store lookup and the placement of
the reused K/V (copy + re-rotation, the same for every backend) are timed apart. Ratios are against the
``full`` backend (every token recomputed through the combine path) and against a plain prefill (the
engine's ordinary forward over the same tokens, PIC off), both measured in the same run.
Targets: epic >= 5x faster than full prefill, cacheblend >= 2x.

With --batch N it also times N such requests (the same documents in other orders, other questions) combined as
one engine step does: one forward for all (``backend.combine_many``) against one combine after another,
alternating, and prints the ratio.

    python tools/bench_pic.py                                   # mistral-like, hidden 512, 8 layers, 8 x 512 + 64
    python tools/bench_pic.py --family qwen3_5                  # hypic on a hybrid model (vs plain prefill)
    python tools/bench_pic.py --threads 1 --profile             # where each combine's time goes
    python tools/bench_pic.py --num-segments 4 --segment-len 128 --batch 4   # a step's combines, batched or not

Shares the engine harness of tools/pic_quality.py (run from anywhere: this directory is on sys.path).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nebula_engine.model.tiny import TINY_FAMILIES
from nebula_engine.pic.backends import get_pic_backend
from pic_quality import HYBRID_FAMILIES, PICHarness, PromptShape, RagPrompt, TinyModel

ATTENTION_BACKENDS = ("full", "naive", "epic:k=16", "cacheblend:ratio=0.15", "a3:ratio=0.15", "prophet:ratio=0.2")
HYBRID_BACKENDS = ("hypic",)
GOALS = {"epic": 5.0, "cacheblend": 2.0}  # minimum speed-up over full prefill
PLAIN = "plain prefill"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="mistral", choices=TINY_FAMILIES)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--num-segments", type=int, default=8)
    parser.add_argument("--segment-len", type=int, default=512)
    parser.add_argument("--query-len", type=int, default=64)
    parser.add_argument("--backend", action="append", default=None,
                        help="backend spec, repeatable (default: full, naive, epic:k=16, cacheblend:ratio=0.15, "
                             "a3:ratio=0.15; hybrid families: hypic)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (median is reported)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="also profile one combine per backend (top ops)")
    parser.add_argument("--batch", type=int, default=0,
                        help="also time this many requests combined in one forward against one after another")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.batch < 0 or args.batch == 1:
        parser.error("--batch must be 0 (off) or at least 2")
    return args


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class CombineBench:
    """One prompt, warm segments, one request's pages reused by every measurement."""

    def __init__(self, harness: PICHarness, prompt: RagPrompt, specs: list[str]):
        self.harness = harness
        self.backends = {spec: harness.backend(spec) for spec in specs}
        for backend in self.backends.values():
            harness.warm(backend, prompt)
        self.segmented = harness.segmented(prompt)
        self.token_ids = list(self.segmented.token_ids)
        self.block_table = harness.allocate(len(self.token_ids))
        self.recomputed: dict[str, int] = {}

    @torch.inference_mode()
    def plain_prefill(self) -> float:
        return timed(lambda: self.harness.forward(self.token_ids, self.block_table, 0))

    @torch.inference_mode()
    def combine(self, spec: str) -> tuple[float, float]:
        """(seconds to look up and place the reused K/V, seconds of ``backend.combine``)."""
        backend, runs = self.backends[spec], []
        place = timed(lambda: runs.append(self.harness.combine_run(backend, self.segmented, self.block_table)))
        results = []
        seconds = timed(lambda: results.append(backend.combine(runs[0])))
        self.recomputed[spec] = results[0].num_recomputed
        return place, seconds

    def measure(self, repeats: int) -> tuple[dict[str, float], float]:
        """(median seconds per backend and for plain prefill, median placement seconds)."""
        names = [PLAIN, *self.backends]
        samples: dict[str, list[float]] = {name: [] for name in names}
        places: list[float] = []
        for repeat in range(repeats + 1):  # the first is a warm-up
            for name in names:
                if name == PLAIN:
                    seconds = self.plain_prefill()
                else:
                    place, seconds = self.combine(name)
                    places.append(place)
                if repeat:
                    samples[name].append(seconds)
        return {name: statistics.median(s) for name, s in samples.items()}, statistics.median(places[1:])

    @torch.inference_mode()
    def profile(self, spec: str, row_limit: int = 12) -> str:
        from torch.profiler import ProfilerActivity, profile

        run = self.harness.combine_run(self.backends[spec], self.segmented, self.block_table)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.backends[spec].combine(run)
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)


class BatchBench:
    """``batch`` requests over the same cached documents, each in its own pages: their combines timed one after
    another and as one ``combine_many`` forward."""

    def __init__(self, harness: PICHarness, prompt: RagPrompt, specs: list[str], batch: int, seed: int):
        self.harness = harness
        self.backends = {spec: harness.backend(spec) for spec in specs}
        rng = random.Random(seed)
        low, high = harness.vocab_range()
        self.segmented = []
        for _ in range(batch):
            order = list(prompt.order)
            rng.shuffle(order)
            question = tuple(rng.randrange(low, high) for _ in prompt.question)
            self.segmented.append(harness.segmented(dataclasses.replace(prompt, order=tuple(order), question=question)))
        self.block_tables = [harness.allocate(len(s.token_ids)) for s in self.segmented]

    @torch.inference_mode()
    def combine(self, spec: str, together: bool) -> float:
        backend = self.backends[spec]
        runs = [self.harness.combine_run(backend, s, table) for s, table in zip(self.segmented, self.block_tables)]
        if together:
            return timed(lambda: backend.combine_many(runs))
        return timed(lambda: [backend.combine(run) for run in runs])

    def measure(self, repeats: int) -> dict[str, tuple[float, float]]:
        """Per backend, median seconds (one after another, together)."""
        samples = {spec: ([], []) for spec in self.backends}
        for repeat in range(repeats + 1):  # the first is a warm-up
            for spec in self.backends:
                for together in (False, True):
                    seconds = self.combine(spec, together)
                    if repeat:
                        samples[spec][together].append(seconds)
        return {spec: (statistics.median(apart), statistics.median(joint)) for spec, (apart, joint) in samples.items()}


def format_batch(batch: int, medians: dict[str, tuple[float, float]]) -> str:
    lines = [f"\n{batch} requests' combines in one step (the same documents in other orders, other questions):",
             f"{'backend':<24} {'one by one ms':>14} {'together ms':>12} {'x':>6}"]
    for spec, (apart, joint) in medians.items():
        lines.append(f"{spec:<24} {1e3 * apart:14.1f} {1e3 * joint:12.1f} {apart / joint:6.2f}")
    return "\n".join(lines)


def report(args: argparse.Namespace, medians: dict[str, float], place: float, bench: CombineBench) -> dict:
    baseline = "full" if "full" in medians else PLAIN
    rows = []
    for name, seconds in medians.items():
        goal = GOALS.get(name.split(":")[0])
        speedup = medians[baseline] / seconds
        rows.append({"backend": name, "ms": 1e3 * seconds, "num_recomputed": bench.recomputed.get(name),
                     "speedup_vs_full": medians["full"] / seconds if "full" in medians else None,
                     "speedup_vs_plain": medians[PLAIN] / seconds,
                     "goal": goal, "goal_met": None if goal is None else speedup >= goal})
    return {"config": {k: v for k, v in vars(args).items() if k not in ("out", "profile")},
            "threads": torch.get_num_threads(), "num_tokens": len(bench.token_ids),
            "num_reused": args.num_segments * args.segment_len, "baseline": baseline, "place_ms": 1e3 * place,
            "results": rows}


def format_report(result: dict) -> str:
    c = result["config"]
    lines = [f"{c['family']}: hidden {c['hidden_size']}, {c['layers']} layers, {c['num_segments']} cached segments x "
             f"{c['segment_len']} + {c['query_len']}-token query = {result['num_tokens']} tokens, fp32 CPU, "
             f"{result['threads']} threads, median of {c['repeats']}",
             f"{'backend':<24} {'recomputed':>10} {'ms':>10} {'x vs full':>10} {'x vs plain':>11}  goal"]
    for row in result["results"]:
        recomputed = "-" if row["num_recomputed"] is None else str(row["num_recomputed"])
        vs_full = "-" if row["speedup_vs_full"] is None else f"{row['speedup_vs_full']:.2f}"
        goal = "" if row["goal"] is None else f">= {row['goal']:.0f}x vs {result['baseline']}: " \
                                              f"{'met' if row['goal_met'] else 'NOT met'}"
        lines.append(f"{row['backend']:<24} {recomputed:>10} {row['ms']:10.1f} {vs_full:>10} "
                     f"{row['speedup_vs_plain']:11.2f}  {goal}")
    lines.append(f"store lookup + placing the reused K/V (copy + re-rotation; every backend, not in the times "
                 f"above): {result['place_ms']:.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    shape = PromptShape(system_len=0, num_docs=args.num_segments, doc_len=args.segment_len, question_len=args.query_len)
    specs = args.backend or list(HYBRID_BACKENDS if args.family in HYBRID_FAMILIES else ATTENTION_BACKENDS)
    with tempfile.TemporaryDirectory(prefix="nebula-bench-pic-") as tmp:
        tiny = TinyModel(args.family, args.hidden_size, args.layers, args.num_heads, args.num_kv_heads,
                         max_positions=max(4096, 2 * shape.max_tokens), seed=args.seed)
        checkpoint = tiny.write(tmp)
        formats = {get_pic_backend(spec).cache_format for spec in specs}  # segments are cached once per format
        doc_pages = -(-args.segment_len // args.page_size)
        num_pages = (len(formats) * args.num_segments * doc_pages
                     + (1 + args.batch) * -(-shape.max_tokens // args.page_size) + 4)
        harness = PICHarness(checkpoint, num_pages, args.page_size)
        prompt = RagPrompt.random(shape, harness.vocab_range(), args.seed)
        bench = CombineBench(harness, prompt, specs)
        medians, place = bench.measure(args.repeats)
        result = report(args, medians, place, bench)
        print(format_report(result))
        if args.batch:
            batched = BatchBench(harness, prompt, specs, args.batch, args.seed).measure(args.repeats)
            result["batch"] = {spec: {"one_by_one_ms": 1e3 * apart, "together_ms": 1e3 * joint}
                               for spec, (apart, joint) in batched.items()}
            print(format_batch(args.batch, batched))
        if args.profile:
            for spec in specs:
                print(f"\n--- profile of one {spec} combine ---\n{bench.profile(spec)}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()

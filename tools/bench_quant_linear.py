"""Quantized linears (``kernels/quant_linear.py``) against fp32 on SmolLM2-135M's and Qwen2.5-0.5B's shapes, plus this
machine's memory bandwidth, in one process.

For each layer shape and x rows (1: a decode step; 32: a batched decode; 512: a prefill) it times the quantized
kernel, ``F.linear`` on the fp32 weight (MKL) and the engine's fp32 path (``cpu_linear.linear``, oneDNN with a
packed weight), the best of --repeats, and prints the ratios and the weight bytes read per second. The block
types are the ones the two GGUF files use for each tensor; blocks are random with sane scales. Each timing walks
through --cold-mb of distinct copies of the weight, as a decode step walks through a model too big for the caches.

--sweep-rows times both quantized paths (streaming GEMV and panel GEMM) over row counts, to place
``GEMM_MIN_ROWS``; --sweep-panels times the GEMM path over panel heights (``PANEL_ROWS``); --compare-paths times
the kernel's instruction-set paths (portable, AVX2, AVX-512) against each other instead of against fp32.

    python tools/bench_quant_linear.py --threads 2
    python tools/bench_quant_linear.py --threads 2 --sweep-rows --sweep-panels --only qwen
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

# (model, layer, out features, in features, ggml type name as the model's GGUF stores it)
SHAPES = [
    ("smollm2", "qkv", 960, 576, "Q4_1"),
    ("smollm2", "o_proj", 576, 576, "Q4_1"),
    ("smollm2", "gate/up", 1536, 576, "Q4_1"),
    ("smollm2", "down", 576, 1536, "Q4_1"),
    ("smollm2", "lm_head", 49152, 576, "Q8_0"),
    ("qwen", "q/k", 1024, 896, "Q5_0"),
    ("qwen", "o_proj", 896, 896, "Q5_0"),
    ("qwen", "gate/up", 4864, 896, "Q5_0"),
    ("qwen", "down", 896, 4864, "Q6_K"),
    ("qwen", "down(Q4_K)", 896, 4864, "Q4_K"),
    ("qwen", "lm_head", 151936, 896, "Q8_0"),
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512])
    parser.add_argument("--repeats", type=int, default=5, help="timings per figure; the best counts")
    parser.add_argument("--only", choices=["smollm2", "qwen"], help="one model's shapes")
    parser.add_argument("--prefill-lm-head", action="store_true",
                        help="also time the LM heads at 512 rows (a prefill computes logits of its last token only)")
    parser.add_argument("--sweep-rows", action="store_true", help="GEMV against panel GEMM over row counts")
    parser.add_argument("--sweep-panels", action="store_true", help="the GEMM path over panel heights")
    parser.add_argument("--compare-paths", action="store_true",
                        help="the kernel's paths (portable, AVX2, AVX-512: those this CPU runs) against each other")
    parser.add_argument("--cold-mb", type=int, default=256,
                        help="fp32 MiB of distinct weight copies each timing walks through (0: one hot copy)")
    return parser.parse_args()


def copies_of(weight, dense_bytes: int, cold_bytes: int):
    """Enough distinct copies of ``weight`` that, read one after another, the fp32 ones far exceed the caches (a
    decode step streams a model's weights from memory; one weight timed again and again would sit in L3)."""
    from nebula_engine.kernels.quant_linear import QuantizedWeight

    count = max(1, -(-cold_bytes // dense_bytes))
    quantized = [QuantizedWeight(weight.data.clone(), weight.qtype, weight.shape) for _ in range(count)]
    return quantized, [q.dequantize() for q in quantized]


def each(fn, weights):
    """A function timing ``fn`` over every copy; ``per_call`` divides its seconds back to one call."""
    return lambda: [fn(w) for w in weights]


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def random_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, row bytes] of random blocks: random quants, fp16 scales near 1e-2 (sub-scales random)."""
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block, block_bytes), dtype=np.uint8)
    name = qtype.name
    scale_offsets = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(name, (0, 2) if name.endswith("_1") else (0,))
    for offset in scale_offsets:
        blocks[:, offset:offset + 2] = rng.uniform(5e-3, 1.5e-2, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> tuple[float, float]:
    """(copy GB/s counting read + write, read GB/s of a sum) over arrays far larger than the caches."""
    source = torch.ones(megabytes * 2**20 // 4)
    dest = torch.empty_like(source)
    copy = best_seconds(lambda: dest.copy_(source), repeats)
    read = best_seconds(lambda: source.sum(), repeats)
    return 2 * source.nbytes / copy / 1e9, source.nbytes / read / 1e9


def compare(args: argparse.Namespace) -> None:
    import gguf

    from nebula_engine.kernels import cpu_linear
    from nebula_engine.kernels.quant_linear import QuantizedWeight, quantized_linear

    print(f"{'model':8s} {'layer':11s} {'N x K':>13s} {'type':5s} {'rows':>4s} {'quant ms':>9s} {'F.linear':>9s} "
          f"{'packed':>9s} {'F/quant':>7s} {'packed/q':>8s} {'quant GB/s':>10s} {'fp32 GB/s':>9s}")
    for seed, (model, layer, rows, cols, type_name) in enumerate(SHAPES):
        if args.only and model != args.only:
            continue
        qtype = gguf.GGMLQuantizationType[type_name]
        weight = QuantizedWeight.from_numpy(random_blocks(qtype, rows, cols, seed), qtype, (rows, cols))
        weights, denses = copies_of(weight, rows * cols * 4, args.cold_mb * 2**20)
        count = len(weights)
        with torch.no_grad():
            for dense in denses:
                cpu_linear.packed_weight(dense)
            for m in args.rows:
                if m >= 512 and layer == "lm_head" and not args.prefill_lm_head:
                    continue
                x = torch.randn(m, cols)
                quant = best_seconds(each(lambda w: quantized_linear(x, w), weights), args.repeats) / count
                plain = best_seconds(each(lambda w: F.linear(x, w), denses), args.repeats) / count
                packed = best_seconds(each(lambda w: cpu_linear.linear(x, w), denses), args.repeats) / count
                print(f"{model:8s} {layer:11s} {rows:6d}x{cols:<6d} {type_name:5s} {m:4d} {quant * 1e3:9.3f} "
                      f"{plain * 1e3:9.3f} {packed * 1e3:9.3f} {plain / quant:7.2f} {packed / quant:8.2f} "
                      f"{weight.nbytes / quant / 1e9:10.1f} {rows * cols * 4 / min(plain, packed) / 1e9:9.1f}",
                      flush=True)
        del weights, denses


def sweep_rows(args: argparse.Namespace) -> None:
    """Both quantized paths at each row count: GEMV (gemm_min_rows above it) and panel GEMM (at or below it)."""
    import gguf

    from nebula_engine.kernels import quant_linear
    from nebula_engine.kernels.quant_linear import QuantizedWeight, quantized_linear

    print("rows: GEMV ms / panel-GEMM ms (GEMV/GEMM > 1: the GEMM path is faster)")
    for seed, (model, layer, rows, cols, type_name) in enumerate(SHAPES):
        if (args.only and model != args.only) or layer == "lm_head":
            continue
        qtype = gguf.GGMLQuantizationType[type_name]
        weight = QuantizedWeight.from_numpy(random_blocks(qtype, rows, cols, seed), qtype, (rows, cols))
        weights, _ = copies_of(weight, rows * cols * 4, args.cold_mb * 2**20)
        cells = []
        for m in (1, 4, 8, 16, 24, 32, 48, 64, 96):
            x = torch.randn(m, cols)
            times = []
            for threshold in (m + 1, m):  # GEMV, then GEMM
                quant_linear.GEMM_MIN_ROWS = threshold
                times.append(best_seconds(each(lambda w: quantized_linear(x, w), weights), args.repeats)
                             / len(weights))
            cells.append(f"{m}:{times[0] * 1e3:.2f}/{times[1] * 1e3:.2f}={times[0] / times[1]:.2f}")
        print(f"{model:8s} {layer:11s} {type_name:5s} " + "  ".join(cells), flush=True)


def compare_paths(args: argparse.Namespace) -> None:
    """The quantized kernel under each instruction set this CPU runs, same weights and x: ms, GB/s of weight read,
    and each path's speed over the AVX2 one."""
    import gguf

    from nebula_engine.kernels import quant_linear
    from nebula_engine.kernels.quant_linear import QuantizedWeight, quantized_linear

    paths = quant_linear.instruction_sets()
    print(f"{'model':8s} {'layer':11s} {'type':5s} {'rows':>4s} " + " ".join(f"{p + ' ms':>12s} {'GB/s':>5s}" for p in paths)
          + "  " + " ".join(f"{p + '/avx2':>12s}" for p in paths if p != "avx2"))
    for seed, (model, layer, rows, cols, type_name) in enumerate(SHAPES):
        if args.only and model != args.only:
            continue
        qtype = gguf.GGMLQuantizationType[type_name]
        weight = QuantizedWeight.from_numpy(random_blocks(qtype, rows, cols, seed), qtype, (rows, cols))
        weights, _ = copies_of(weight, rows * cols * 4, args.cold_mb * 2**20)
        with torch.no_grad():
            for m in args.rows:
                if m >= 512 and layer == "lm_head" and not args.prefill_lm_head:
                    continue
                x = torch.randn(m, cols)
                seconds = {}
                for path in paths:
                    previous = quant_linear.set_instruction_set(path)
                    seconds[path] = best_seconds(each(lambda w: quantized_linear(x, w), weights),
                                                 args.repeats) / len(weights)
                    quant_linear.set_instruction_set(previous)
                cells = " ".join(f"{seconds[p] * 1e3:12.3f} {weight.nbytes / seconds[p] / 1e9:5.1f}" for p in paths)
                ratios = " ".join(f"{seconds['avx2'] / seconds[p]:12.2f}" for p in paths if p != "avx2"
                                  and "avx2" in seconds)
                print(f"{model:8s} {layer:11s} {type_name:5s} {m:4d} {cells}  {ratios}", flush=True)
        del weights


def sweep_panels(args: argparse.Namespace) -> None:
    import gguf

    from nebula_engine.kernels import quant_linear
    from nebula_engine.kernels.quant_linear import QuantizedWeight, quantized_linear

    quant_linear.GEMM_MIN_ROWS = 1
    print("panel rows: ms of the GEMM path at 512 rows")
    for seed, (model, layer, rows, cols, type_name) in enumerate(SHAPES):
        if (args.only and model != args.only) or layer == "lm_head":
            continue
        qtype = gguf.GGMLQuantizationType[type_name]
        weight = QuantizedWeight.from_numpy(random_blocks(qtype, rows, cols, seed), qtype, (rows, cols))
        x = torch.randn(512, cols)
        cells = []
        for panel in (64, 128, 256, 512, 1024, 4096):
            quant_linear.PANEL_ROWS = panel
            cells.append(f"{panel}:{best_seconds(lambda: quantized_linear(x, weight), args.repeats) * 1e3:.2f}")
        print(f"{model:8s} {layer:11s} {type_name:5s} " + "  ".join(cells), flush=True)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from nebula_engine.kernels import quant_linear

    if not quant_linear.load():
        raise SystemExit("the quantized-linear kernel did not build (see the warning above)")
    copy, read = memory_bandwidth()
    paths = ", ".join(quant_linear.instruction_sets())
    print(f"{torch.get_num_threads()} threads, kernel paths: {paths}; memory bandwidth (512 MiB "
          f"arrays): copy {copy:.1f} GB/s (read + write), read {read:.1f} GB/s (a sum)", flush=True)
    gemm_min_rows, panel_rows = quant_linear.GEMM_MIN_ROWS, quant_linear.PANEL_ROWS
    if args.sweep_rows:
        sweep_rows(args)
    if args.sweep_panels:
        sweep_panels(args)
    quant_linear.GEMM_MIN_ROWS, quant_linear.PANEL_ROWS = gemm_min_rows, panel_rows
    if args.compare_paths:
        compare_paths(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()

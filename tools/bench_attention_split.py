"""Causal attention over a cached context on CPU: SDPA with an [Lq, Lk] mask against the split of
``kernels.attention._split_causal_attention`` (unmasked parts merged through their log-sum-exps).

Two shapes of the default compare (bench-qwen3: 8 query heads, 2 KV heads of 32, one thread per peer), read from
its RAGPulse replay: a prefill chunk of 1,800 tokens after 850 cached ones, and a PIC combine's 720 recomputed rows
scattered over 2,730 positions. Both paths run in one process, alternating, best of --repeats; prints ms and the
ratio, and for the scattered rows each block size of ``SPLIT_BLOCK_ROWS``' sweep.

    python tools/bench_attention_split.py
    python tools/bench_attention_split.py --threads 2 --heads 9 --kv-heads 3 --head-dim 64   # SmolLM2's heads
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from nebula_engine.kernels import attention


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    return parser.parse_args()


def masked(q, k, v, scale, positions):
    """The path before the split: one SDPA call with the boolean mask keys <= position."""
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    mask = torch.arange(k.shape[0])[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    scale = args.head_dim**-0.5

    def tensors(q_len, ctx_len):
        return (torch.randn(q_len, args.heads, args.head_dim, generator=generator),
                torch.randn(ctx_len, args.kv_heads, args.head_dim, generator=generator),
                torch.randn(ctx_len, args.kv_heads, args.head_dim, generator=generator))

    print(f"{args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, fp32, {args.threads} thread(s), "
          f"best of {args.repeats}")
    q, k, v = tensors(1800, 2648)
    end = torch.arange(2648 - 1800, 2648)
    before = best_ms(lambda: masked(q, k, v, scale, end), args.repeats)
    after = best_ms(lambda: attention.causal_attention(q, k, v, scale), args.repeats)
    print(f"chunk of 1800 after 848 cached   masked {before:7.1f} ms   split {after:7.1f} ms   {before / after:.2f}x")

    q, k, v = tensors(720, 2730)
    rows = torch.randperm(2730, generator=generator)[:720].sort().values
    before = best_ms(lambda: masked(q, k, v, scale, rows), args.repeats)
    default = attention.SPLIT_BLOCK_ROWS
    try:
        for block in args.block_rows:
            attention.SPLIT_BLOCK_ROWS = block
            after = best_ms(lambda: attention.causal_attention(q, k, v, scale, q_positions=rows), args.repeats)
            print(f"720 rows scattered over 2730     masked {before:7.1f} ms   split {after:7.1f} ms   "
                  f"{before / after:.2f}x   ({block} rows a block)")
    finally:
        attention.SPLIT_BLOCK_ROWS = default


if __name__ == "__main__":
    main()

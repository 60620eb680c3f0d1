"""Cost of reusing cached KV vs recomputing it, for the planner: TTFT and per-token promotion cost.

Measures, on one random model and one prompt length, medians over --repeats:
  - TTFT (one sampled token) of an uncached prompt vs the same prompt fully cached on the device;
  - TTFT when the prompt's pages were demoted to host memory / local disk and are promoted back,
    plus the promotion time alone, per token, against the per-token cost of recomputing.
Prints ratios measured in the same run (no absolute claims).

    python tools/bench_cache.py --hidden-size 512 --num-layers 8 --prompt-len 1024 --threads 1

(On a shared CPU, --threads 1 avoids the oversubscription stalls that make multi-threaded timings noisy.)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen3", choices=["mistral", "qwen3", "qwen3_moe"])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    return parser.parse_args()


def make_checkpoint(args: argparse.Namespace, out_dir: str) -> str:
    from nebula_engine.model.tiny import make_tiny_checkpoint

    settings = dict(hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                    num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                    head_dim=args.hidden_size // args.num_heads, intermediate_size=int(3.5 * args.hidden_size),
                    max_position_embeddings=max(4096, 4 * args.prompt_len))
    return str(make_tiny_checkpoint(args.family, out_dir, **settings))


def prompt(args: argparse.Namespace, seed: int) -> dict:
    tokens = torch.randint(5, 20000, (args.prompt_len,), generator=torch.Generator().manual_seed(seed))
    return {"prompt_token_ids": tokens.tolist()}


def ttft(llm, request: dict) -> float:
    from nebula_engine import SamplingParams

    start = time.perf_counter()
    llm.generate(request, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - start


class PromotionTimer:
    """Wraps ``CacheStore.promote_prefix`` to time promotions and count the tokens they bring back."""

    def __init__(self, cache):
        self.seconds, self.tokens = 0.0, 0
        inner, page_size = cache.promote_prefix, cache.page_size

        def timed(node, token_ids):
            start = time.perf_counter()
            result = inner(node, token_ids)
            self.seconds += time.perf_counter() - start
            self.tokens += len(result[1]) * page_size
            return result
        cache.promote_prefix = timed


def bench_tier(args, checkpoint: str, tier_options: dict) -> tuple[float, float]:
    """(median TTFT of a prompt promoted from the tier, median promotion seconds per token)."""
    from nebula_engine import LLM

    pages = -(-args.prompt_len // args.page_size) + 2
    llm = LLM(checkpoint, num_pages=pages, page_size=args.page_size, device=args.device, **tier_options)
    cache = llm.llm_engine.scheduler.prefix_cache.cache
    timer = PromotionTimer(cache)
    ttfts, per_token = [], []
    for repeat in range(args.repeats):
        target = prompt(args, seed=100 + repeat)
        ttft(llm, target)
        ttft(llm, prompt(args, seed=200 + repeat))  # pushes every page of target off the device
        cache.flush()
        timer.seconds, timer.tokens = 0.0, 0
        ttfts.append(ttft(llm, target))
        if timer.tokens == 0:
            raise SystemExit(f"no promotion happened with {tier_options}: pool or tier too small")
        per_token.append(timer.seconds / timer.tokens)
    cache.close()
    return statistics.median(ttfts), statistics.median(per_token)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from nebula_engine import LLM

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_checkpoint(args, f"{tmp}/model")
        num_pages = 4 * (args.prompt_len // args.page_size + 2)
        common = dict(page_size=args.page_size, device=args.device, num_pages=num_pages)
        uncached_llm = LLM(checkpoint, enable_prefix_caching=False, **common)
        ttft(uncached_llm, prompt(args, seed=0))  # warm-up
        uncached = statistics.median(ttft(uncached_llm, prompt(args, seed=1 + r)) for r in range(args.repeats))
        cached_llm = LLM(checkpoint, **common)
        ttft(cached_llm, prompt(args, seed=0))
        cached = statistics.median(ttft(cached_llm, prompt(args, seed=0)) for _ in range(args.repeats))
        capacity = 4 * args.prompt_len
        host_ttft, host_tok = bench_tier(args, checkpoint, dict(host_cache_tokens=capacity))
        disk_ttft, disk_tok = bench_tier(args, checkpoint, dict(disk_cache_tokens=capacity,
                                                                disk_cache_path=f"{tmp}/disk"))
    recompute_tok = uncached / args.prompt_len
    print(f"prompt {args.prompt_len} tokens, page {args.page_size}, hidden {args.hidden_size} x {args.num_layers} "
          f"layers, {args.device}")
    print(f"TTFT uncached         {uncached * 1e3:9.2f} ms")
    print(f"TTFT device hit       {cached * 1e3:9.2f} ms   uncached/cached = {uncached / cached:6.2f}x")
    print(f"TTFT host promote     {host_ttft * 1e3:9.2f} ms   uncached/host   = {uncached / host_ttft:6.2f}x")
    print(f"TTFT disk promote     {disk_ttft * 1e3:9.2f} ms   uncached/disk   = {uncached / disk_ttft:6.2f}x")
    print(f"per token: recompute {recompute_tok * 1e6:8.2f} us, promote from host {host_tok * 1e6:8.2f} us "
          f"({recompute_tok / host_tok:.2f}x cheaper), from disk {disk_tok * 1e6:8.2f} us "
          f"({recompute_tok / disk_tok:.2f}x cheaper)")


if __name__ == "__main__":
    main()

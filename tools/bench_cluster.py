"""The real cluster on this machine, one process per peer, replaying a RAGPulse slice at a fixed Poisson rate
under the three policies (pc, local-pic, nebula): TTFT P50/P99 and CHR, as ratios against pc.

    python tools/bench_cluster.py [--num-requests 48] [--qps 1.0] [--prefill-workers 2] [--decode-workers 1]

Same code as `nebula-engine compare` (the repo's main job); NIXL page throughput is tools/bench_transfer.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nebula_engine.bench.cluster_compare import CompareOptions, bench_model_dir, compare, format_table


def main() -> None:
    defaults = CompareOptions()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--trace", default=defaults.trace)
    parser.add_argument("--num-requests", type=int, default=defaults.num_requests)
    parser.add_argument("--qps", type=float, default=defaults.qps)
    parser.add_argument("--prefill-workers", type=int, default=defaults.prefill_workers)
    parser.add_argument("--decode-workers", type=int, default=defaults.decode_workers)
    parser.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--pic-backend", default=defaults.pic_backend)
    parser.add_argument("--out", type=Path, default=Path("bench_results/cluster"))
    args = parser.parse_args()
    options = CompareOptions(trace=args.trace, num_requests=args.num_requests, qps=args.qps,
                             prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
                             max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                             pic_backend=args.pic_backend)
    model = args.model or str(bench_model_dir())
    print(format_table(compare(model, options, args.out)))


if __name__ == "__main__":
    main()

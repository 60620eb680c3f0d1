"""Prefix caching on a hybrid model (random tiny Qwen3.5): time to first token of a repeated prompt, with prefix
caching (its checkpoint's K/V and linear-attention state restored) against without (the baseline), same process.

    python tools/bench_hybrid_prefix.py --prompt-len 1024 --hidden 256 --layers 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from nebula_engine import LLM, SamplingParams
from nebula_engine.model.tiny import make_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Qwen3.5's pattern: 3 linear-attention layers, then 1 full-attention layer
    layer_types = [("full_attention" if i % 4 == 3 else "linear_attention") for i in range(args.layers)]
    checkpoint = make_tiny_checkpoint("qwen3_5", tempfile.mkdtemp(), hidden_size=args.hidden,
                                      num_hidden_layers=args.layers, layer_types=layer_types)
    prompt = {"prompt_token_ids": torch.randint(5, 1000, (args.prompt_len,),
                                                generator=torch.Generator().manual_seed(0)).tolist()}
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    num_pages = 2 * (args.prompt_len // args.page_size + 1) + 64
    medians = {}
    for caching in (False, True):
        llm = LLM(str(checkpoint), enable_prefix_caching=caching, page_size=args.page_size, num_pages=num_pages,
                  max_num_batched_tokens=512)
        first = llm.generate(prompt, params)[0]  # warm-up; with caching it also caches the prompt
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            output = llm.generate(prompt, params)[0]
            times.append(time.perf_counter() - start)
        assert output.outputs[0].token_ids == first.outputs[0].token_ids
        medians[caching] = statistics.median(times)
        line = f"prefix caching {'on ' if caching else 'off'}: TTFT median {medians[caching] * 1e3:8.1f} ms, " \
               f"cached tokens {output.num_cached_tokens}"
        if caching:
            state = llm.llm_engine.scheduler.kv_cache.state_io
            line += f", one cached state = {state.num_pages} page(s) of {state.blob.page_bytes} B"
        print(line)
    print(f"TTFT ratio on/off: {medians[True] / medians[False]:.2f}")


if __name__ == "__main__":
    main()

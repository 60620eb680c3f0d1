"""Prefill throughput and batched decode latency: our engine vs transformers, same weights, same process.

Ours runs the real path (scheduler -> model runner -> paged KV cache -> sampler) through LLMEngine.step;
transformers runs its bare forward with its own DynamicCache (built from the config, so Qwen3.5 gets its
linear-attention state layers) and ``logits_to_keep=1`` (no generate overhead).
Prints ratios ours/HF: >1 for prefill tokens/s means we are faster; <1 for decode latency means faster.
Shapes scale with --hidden-size / --num-heads: DeepSeek-V2 is V2-Lite-shaped (R = hidden/4, Dn = Dv = head dim,
Dr = head dim/2, latent cache), Qwen3.5 repeats 3 linear-attention layers + 1 full-attention layer.

    python tools/bench_forward.py --hidden-size 512 --num-layers 8 --prompt-len 1024 --batch-size 4
    python tools/bench_forward.py --family deepseek_v2 --hidden-size 256 --num-layers 4 --prompt-len 256
    python tools/bench_forward.py --model smollm2 --prompt-len 512 --batch-size 1   # a real model, as it is
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint directory, .gguf file or short name (smollm2) to measure "
                                        "instead of a random --family model; the size options are then unused")
    parser.add_argument("--family", default="mistral",
                        choices=["llama", "mistral", "qwen3", "qwen3_moe", "deepseek_v2", "qwen3_5", "qwen3_5_moe"])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="prefill measurements (median is reported)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    return parser.parse_args()


def family_overrides(args: argparse.Namespace) -> dict:
    """HF config fields of the MoE / MLA / hybrid families, scaled from the common sizes."""
    hidden, heads, head_dim = args.hidden_size, args.num_heads, args.hidden_size // args.num_heads
    moe = dict(num_experts_per_tok=4, moe_intermediate_size=hidden // 2)
    if args.family == "deepseek_v2":
        return dict(moe, num_key_value_heads=None, kv_lora_rank=hidden // 4, qk_nope_head_dim=head_dim,
                    qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim, n_routed_experts=16, n_shared_experts=2)
    if args.family.startswith("qwen3_5"):
        if args.num_layers % 4:
            raise SystemExit("--num-layers must be a multiple of 4 for Qwen3.5 (3 linear + 1 full attention)")
        half = head_dim // 8  # RoPE on a quarter of the head: half of that in pairs, split over 3 MRoPE rows
        hybrid = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=heads // 2,
                      linear_num_value_heads=heads, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                       "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
                                       "mrope_interleaved": True})
        hybrid["layer_types"] = hybrid["layer_types"] * (args.num_layers // 4)
        if args.family == "qwen3_5_moe":
            hybrid.update(moe, num_experts=16, shared_expert_intermediate_size=hidden // 2)
        return hybrid
    return {}  # mistral, qwen3, qwen3_moe: the tiny defaults (qwen3_moe: 8 experts, top-2, width 32)


def make_checkpoint(args: argparse.Namespace, out_dir: str) -> str:
    from nebula_engine.model.tiny import make_tiny_checkpoint

    settings = dict(hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                    num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                    head_dim=args.hidden_size // args.num_heads, intermediate_size=int(3.5 * args.hidden_size),
                    max_position_embeddings=max(4096, 2 * (args.prompt_len + args.decode_steps)),
                    initializer_range=0.02)
    return str(make_tiny_checkpoint(args.family, out_dir, **{**settings, **family_overrides(args)}))


def random_prompts(args: argparse.Namespace, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (args.batch_size, args.prompt_len), generator=generator)


class OursRunner:
    def __init__(self, checkpoint: str, args: argparse.Namespace):
        from nebula_engine.config import EngineConfig
        from nebula_engine.engine.llm_engine import LLMEngine

        tokens_needed = args.batch_size * (args.prompt_len + args.decode_steps + 1)
        self.engine = LLMEngine(EngineConfig.create(
            checkpoint, page_size=args.page_size, num_pages=-(-tokens_needed // args.page_size) + args.batch_size,
            max_num_seqs=args.batch_size, max_num_batched_tokens=args.batch_size * args.prompt_len))
        self.decode_steps = args.decode_steps
        self._next_id = 0

    def run(self, prompts: torch.Tensor) -> tuple[float, list[float]]:
        """(prefill seconds, per-step decode seconds) for one batch."""
        from nebula_engine import SamplingParams

        params = SamplingParams(max_tokens=self.decode_steps + 1, temperature=0.0, ignore_eos=True)
        for row in prompts.tolist():
            self.engine.add_request(str(self._next_id), row, params)
            self._next_id += 1
        prefill = timed(self.engine.step)
        decode = [timed(self.engine.step) for _ in range(self.decode_steps)]
        assert not self.engine.has_unfinished_requests()
        return prefill, decode


class HFRunner:
    def __init__(self, checkpoint: str, decode_steps: int):
        from transformers import AutoModelForCausalLM

        path = Path(checkpoint)
        if path.suffix == ".gguf":  # transformers' own GGUF loader: a directory plus the file's name
            self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        self.model.eval()
        self.decode_steps = decode_steps

    @torch.inference_mode()
    def run(self, prompts: torch.Tensor) -> tuple[float, list[float]]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        state = {}

        def prefill():
            out = self.model(prompts, cache=cache, use_cache=True, logits_to_keep=1)
            state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)

        def decode():
            out = self.model(state["next"], cache=cache, use_cache=True, logits_to_keep=1)
            state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)

        return timed(prefill), [timed(decode) for _ in range(self.decode_steps)]


class HFGenerateRunner(HFRunner):
    """transformers' ``generate`` (what its users call): per-token decode time from two runs.

    generate(N+1 tokens) - generate(1 token) leaves the N decode steps with all of generate's
    per-step work (logits processing, stopping criteria, cache updates).
    """

    @torch.inference_mode()
    def run(self, prompts: torch.Tensor) -> tuple[float, list[float]]:
        mask = torch.ones_like(prompts)

        def generate(new_tokens: int):
            self.model.generate(prompts, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

        first = timed(lambda: generate(1))
        total = timed(lambda: generate(self.decode_steps + 1))
        return first, [(total - first) / self.decode_steps] * self.decode_steps


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(runners: dict, args: argparse.Namespace, vocab_size: int) -> dict[str, tuple[float, float]]:
    """name -> (best prefill seconds, best per-batch median decode step seconds).

    Runners alternate batch by batch and the best batch counts, so load from other processes on
    the machine hits both sides alike instead of skewing the ratio.
    """
    for runner in runners.values():
        runner.run(random_prompts(args, vocab_size, seed=0))  # warm-up
    best = {name: (float("inf"), float("inf")) for name in runners}
    for repeat in range(args.repeats):
        prompts = random_prompts(args, vocab_size, seed=1 + repeat)
        for name, runner in runners.items():
            prefill, decode = runner.run(prompts)
            best[name] = (min(best[name][0], prefill), min(best[name][1], statistics.median(decode)))
    return best


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from nebula_engine.config import resolve_model

    with tempfile.TemporaryDirectory(prefix="nebula-bench-") as tmp:
        checkpoint = resolve_model(args.model) if args.model else make_checkpoint(args, tmp)
        ours = OursRunner(checkpoint, args)
        config = ours.engine.model_config
        vocab_size = config.vocab_size
        runners = {"ours": ours, "hf": HFRunner(checkpoint, args.decode_steps),
                   "hf-generate": HFGenerateRunner(checkpoint, args.decode_steps)}
        best = measure(runners, args, vocab_size)
    (ours_prefill, ours_decode), (hf_prefill, hf_decode) = best["ours"], best["hf"]
    generate_decode = best["hf-generate"][1]
    tokens = args.batch_size * args.prompt_len
    print(f"{args.model or args.family}: hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
          f"batch {args.batch_size} x "
          f"{args.prompt_len} prompt tokens, {args.decode_steps} decode steps, fp32, {torch.get_num_threads()} threads")
    print(f"prefill tok/s     ours {tokens / ours_prefill:10.1f}   HF {tokens / hf_prefill:10.1f}   "
          f"ratio ours/HF {hf_prefill / ours_prefill:.2f}x")
    print(f"decode ms/step    ours {1e3 * ours_decode:10.2f}   HF {1e3 * hf_decode:10.2f}   "
          f"ratio ours/HF {ours_decode / hf_decode:.2f}x (lower is faster; HF = bare forward + argmax loop)")
    print(f"decode ms/step    ours {1e3 * ours_decode:10.2f}   HF generate {1e3 * generate_decode:7.2f}   "
          f"ratio ours/HF {ours_decode / generate_decode:.2f}x (lower is faster)")


if __name__ == "__main__":
    main()

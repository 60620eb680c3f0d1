"""Prefill and batched decode throughput: our engine vs a peer (transformers, or llama.cpp on the same GGUF file),
same weights, same process, as a fraction of this machine's fp32 GEMM limit and, for decode, of its memory-read
limit.

Ours runs the real path (scheduler -> model runner -> paged KV cache -> sampler) through LLMEngine.step.
transformers runs ``generate`` (greedy, the same batch and new tokens: what its users call) and, for reference,
its bare forward with its own DynamicCache and ``logits_to_keep=1`` (no generate overhead). ``--peer llamacpp``
runs llama.cpp instead (``tools/llamacpp_peer.py``: its C API, one sequence per request, as llama-batched-bench).

- prefill: one prompt of each --prompt-len tokens, tokens/s (ours: the engine steps that prefill it and sample);
- decode: --decode-batches concurrent requests of --decode-prompt-len tokens, --decode-steps new tokens each,
  tokens/s of the decode steps (median step; transformers ``generate``: the median interval between its calls
  of a logits processor, one per new token);
- limit: a 2048³ fp32 matmul with the same threads, GFLOP/s. A figure's fraction of it counts 2 FLOPs per
  weight a token multiplies (the matmul weights; MoE: the experts a token uses; the LM head only for tokens
  whose logits are computed, a prefill's last) plus 4·H·D per context token per attention layer (QK and PV).
  Linear-attention recurrences and MLA's latent attention are left out.
- read limit: the best of 5 sums of a 1 GiB fp32 tensor, GB/s (a STREAM-like read). A decode step reads every
  weight once whatever the batch (its bytes as stored: GGUF blocks or fp32), so weight bytes x steps/s over it
  is the share of the memory limit the step reaches (the KV cache and activations left out).

Prints ratios ours/HF (> 1: we are faster). Runners alternate repeat by repeat and the best repeat counts, so
load from other processes hits both sides alike. Shapes scale with --hidden-size / --num-heads: DeepSeek-V2
is V2-Lite-shaped (R = hidden/4, Dn = Dv = head dim, Dr = head dim/2, latent cache), Qwen3.5 repeats 3
linear-attention layers + 1 full-attention layer.

    python tools/bench_forward.py                                   # random Mistral, hidden 512, 8 layers
    python tools/bench_forward.py --family deepseek_v2 --hidden-size 256 --num-layers 4
    python tools/bench_forward.py --model smollm2 --threads 2       # a real model, as it is
    python tools/bench_forward.py --model qwen2.5-coder-0.5b --threads 2 --peer llamacpp \
        --prompt-len 512 2048 --decode-batches 1 32

``--write-docs`` also writes the figures to the results page docs/results/engine-speed-<model>-vs-<peer>.md.
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
    parser.add_argument("--peer", choices=["transformers", "llamacpp"], default="transformers",
                        help="what ours is compared with; llamacpp needs a GGUF --model and the llamacpp extra")
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[1024],
                        help="prefill: tokens of the one prompt, one measurement each")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 32],
                        help="decode: concurrent requests, one measurement each")
    parser.add_argument("--decode-prompt-len", type=int, default=128, help="decode: prompt tokens per request")
    parser.add_argument("--decode-steps", type=int, default=16, help="decode: new tokens per request measured")
    parser.add_argument("--repeats", type=int, default=2, help="measurements per figure (the best counts)")
    parser.add_argument("--hf-forward", action="store_true",
                        help="also time transformers' bare forward loop for decode (no generate overhead)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--quantization", choices=["gguf", "float32"], default="gguf",
                        help="a GGUF --model's weights: kept in their blocks (gguf) or dequantized at load (float32)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time instead of wall time, for a machine others load "
                             "(with --threads 1 it is the time the work takes when the core is ours)")
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the results page docs/results/engine-speed-<model>-vs-<peer>.md")
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
                    max_position_embeddings=max(4096, 2 * (args.prompt_len + args.decode_prompt_len
                                                           + args.decode_steps)),
                    initializer_range=0.02)
    return str(make_tiny_checkpoint(args.family, out_dir, **{**settings, **family_overrides(args)}))


def random_prompts(batch: int, length: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


class OursRunner:
    def __init__(self, checkpoint: str, args: argparse.Namespace):
        from nebula_engine.config import EngineConfig
        from nebula_engine.engine.llm_engine import LLMEngine

        batch = max(args.decode_batches)
        decode_tokens = batch * (args.decode_prompt_len + args.decode_steps + 1)
        prompt_len = max(args.prompt_len)
        pages = -(-max(decode_tokens, prompt_len + 1) // args.page_size) + batch
        self.engine = LLMEngine(EngineConfig.create(
            checkpoint, page_size=args.page_size, num_pages=pages, max_num_seqs=batch, quantization=args.quantization,
            max_num_batched_tokens=max(prompt_len, batch * args.decode_prompt_len)))
        self._next_id = 0

    def _add(self, prompts: torch.Tensor, max_tokens: int) -> None:
        from nebula_engine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for row in prompts.tolist():
            self.engine.add_request(str(self._next_id), row, params)
            self._next_id += 1

    def prefill(self, prompts: torch.Tensor) -> float:
        """Seconds of the steps that prefill ``prompts`` [B, L] and sample their first token: one step when the
        token budget fits them, more when the scheduler splits a prompt (a hybrid model's prefill ends its chunks
        where a linear-attention state is saved for its prefix cache)."""
        self._add(prompts, max_tokens=1)
        seconds = 0.0
        while self.engine.has_unfinished_requests():
            seconds += timed(self.engine.step)
        return seconds

    def decode(self, prompts: torch.Tensor, steps: int) -> float:
        """Seconds per decode step (median) of ``prompts`` [B, L] decoding together."""
        self._add(prompts, max_tokens=steps + 1)
        started: set[str] = set()
        while len(started) < len(prompts):  # the prefill (one step, or more when it is split) and first tokens
            started.update(output.request_id for output in self.engine.step())
        seconds = [timed(self.engine.step) for _ in range(steps)]
        assert not self.engine.has_unfinished_requests()
        return statistics.median(seconds)


class HFRunner:
    """transformers' bare forward with its DynamicCache (built from the config, so Qwen3.5 gets its
    linear-attention state layers) and ``logits_to_keep=1``."""

    def __init__(self, checkpoint: str):
        from transformers import AutoModelForCausalLM

        path = Path(checkpoint)
        if path.suffix == ".gguf":  # transformers' own GGUF loader: a directory plus the file's name
            self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        self.model.eval()

    @torch.inference_mode()
    def prefill(self, prompts: torch.Tensor) -> float:
        from transformers import DynamicCache

        def run():
            out = self.model(prompts, cache=DynamicCache(config=self.model.config), use_cache=True,
                             logits_to_keep=1)
            out.logits[:, -1].argmax(-1)

        return timed(run)

    @torch.inference_mode()
    def decode(self, prompts: torch.Tensor, steps: int) -> float:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        state = {"next": prompts}

        def forward():
            out = self.model(state["next"], cache=cache, use_cache=True, logits_to_keep=1)
            state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)

        forward()  # the prefill
        return statistics.median(timed(forward) for _ in range(steps))


class HFGenerateRunner(HFRunner):
    """transformers' ``generate``: per-step decode time from inside one run.

    A logits processor stamps the clock each time ``generate`` calls it, once per new token, after that step's
    forward; the median interval between consecutive stamps is one decode step with all of generate's per-step
    work (logits processing, stopping criteria, cache updates). Timing generate(N+1) - generate(1) instead
    subtracted two runs that both include the prompt's prefill, whose run-to-run noise swamped the N steps.
    """

    @torch.inference_mode()
    def decode(self, prompts: torch.Tensor, steps: int) -> float:
        from transformers import LogitsProcessorList

        stamps: list[float] = []

        def stamp(input_ids, scores):
            stamps.append(clock())
            return scores

        self.model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=steps + 1,
                            min_new_tokens=steps + 1, do_sample=False, pad_token_id=0,
                            logits_processor=LogitsProcessorList([stamp]))
        return statistics.median(later - earlier for earlier, later in zip(stamps, stamps[1:]))


def gemm_gflops(size: int = 2048, repeats: int = 5) -> float:
    """The machine's practical fp32 limit: the best of ``repeats`` size³ matmuls, GFLOP/s."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    return 2 * size**3 / min(timed(lambda: torch.mm(a, b)) for _ in range(repeats)) / 1e9


def read_limit_gbs(gib: int = 1, repeats: int = 5) -> float:
    """The machine's practical memory-read limit: the best of ``repeats`` sums of a ``gib`` GiB fp32 tensor, GB/s."""
    data = torch.ones(gib << 28)
    data.sum()
    return data.nbytes / min(timed(data.sum) for _ in range(repeats)) / 1e9


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of the linear layers' weights as stored (GGUF blocks or fp32): what any decode step reads."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight
            total += sum(p.nbytes for p in weight.parts) if hasattr(weight, "parts") else weight.nbytes
    return total


def matmul_weights_per_token(model: torch.nn.Module) -> int:
    """Weights one token multiplies: every linear layer's, MoE experts scaled to the top-k a token uses."""
    from nebula_engine.model.layers import SparseMoE

    experts = {id(p): m for m in model.modules() if isinstance(m, SparseMoE) for p in m.experts.parameters()}
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            total += module.weight.numel()
    for module in {id(m): m for m in experts.values()}.values():
        total += sum(p.numel() for p in module.experts.parameters()) * module.top_k // module.experts.num_experts
    return total


def attention_flops_per_context_token(model) -> int:
    """QK and PV: 2 FLOPs each per head dim per head per attention layer, for each context token seen (MLA's
    latent attention left out, as the module docstring says)."""
    from nebula_engine.model.layers import RopeAttention

    return sum(4 * m.num_heads * m.head_dim for m in model.attention_layers() if isinstance(m, RopeAttention))


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCK["wall"]


def timed(fn) -> float:
    start = clock()
    fn()
    return clock() - start


def best_of(runners: dict, repeats: int, fn) -> dict[str, float]:
    """name -> the least seconds of ``fn(runner, repeat)`` over ``repeats``, runners alternating."""
    best = dict.fromkeys(runners, float("inf"))
    for repeat in range(repeats):
        for name, runner in runners.items():
            best[name] = min(best[name], fn(runner, repeat))
    return best


PAGE_ABOUT = {
    "transformers": (
        "Prefill and batched decode throughput of this engine's real path (scheduler, model runner, paged KV cache, "
        "sampler) against Hugging Face transformers on the same weights in the same process, fp32, runners "
        "alternating repeat by repeat, the best repeat counted. Decode is tokens/s of the decode steps of N "
        "concurrent requests against transformers `generate` with the same batch, greedy. '% of limit' is the "
        "achieved GFLOP/s over this machine's fp32 GEMM limit (a 2048^3 matmul with the same threads)."),
    "llamacpp": (
        "Prefill and batched decode throughput of this engine's real path (scheduler, model runner, paged KV cache, "
        "sampler) against llama.cpp (llama-cpp-python's C API, one sequence per request as llama-batched-bench) on "
        "the same GGUF file in the same process with the same threads, runners alternating repeat by repeat, the "
        "best repeat counted, greedy. '% of limit': prefill, the achieved GFLOP/s over this machine's fp32 GEMM "
        "limit (a 2048^3 matmul); decode, the weight bytes a step reads per second over its memory-read limit "
        "(the best sum of a 1 GiB fp32 tensor)."),
}
PEER_LABEL = {"transformers": "transformers", "llamacpp": "llama.cpp"}


def limit_share(fraction_text: str) -> str:
    """The share in ``fraction``'s text: '12.3 GFLOP/s = 45.6% of limit' -> '45.6%'."""
    return fraction_text.split("= ")[-1].removesuffix(" of limit").strip()


def page_name(peer: str, model: str | None) -> str:
    """``engine-speed-<model>-vs-<peer>``: one page per model and peer, so measuring another model keeps the
    others' pages (a path is reduced to its file name without ``.gguf``)."""
    subject = Path(model).name.lower().removesuffix(".gguf") if model else "random"
    return f"engine-speed-{subject}-vs-{peer}"


def engine_speed_page(peer: str, model: str | None, header: str, rows: list[tuple], limits: tuple[float, float],
                      read_gbs: float):
    from nebula_engine.bench.results_page import ResultsPage, Table

    label = PEER_LABEL[peer]
    table = Table(("figure", "ours tok/s", "ours % of limit", f"{label} tok/s", f"ours / {label}"),
                  tuple(rows), caption=header)
    how = ("transformers runs `generate` for decode and its bare forward for prefill" if peer == "transformers"
           else "llama.cpp decodes one sequence per request, one token each per step")
    notes = (f"{how}; above 1.00 we are faster.",
             f"GEMM limit {limits[0]:.1f} GFLOP/s at the start, {limits[1]:.1f} at the end (how much the machine's "
             f"load changed meanwhile); memory-read limit {read_gbs:.1f} GB/s.")
    return ResultsPage(page_name(peer, model), f"Engine speed against {label}", PAGE_ABOUT[peer], (table,), notes)


def build_peers(args: argparse.Namespace, checkpoint: str) -> tuple[dict, dict, list]:
    """(prefill runners, decode runners, what to close), by ``--peer``; ours comes first in each."""
    if args.peer == "llamacpp":
        if Path(checkpoint).suffix != ".gguf":
            raise SystemExit(f"--peer llamacpp runs a GGUF file; {checkpoint} is not one")
        from llamacpp_peer import LlamaCppRunner

        peer = LlamaCppRunner(checkpoint, threads=torch.get_num_threads(), max_prompt_len=max(args.prompt_len),
                              max_batch=max(args.decode_batches), decode_prompt_len=args.decode_prompt_len,
                              decode_steps=args.decode_steps, clock=clock)
        return {"llama.cpp": peer}, {"llama.cpp": peer}, [peer]
    hf = HFRunner(checkpoint)
    generate = HFGenerateRunner.__new__(HFGenerateRunner)
    generate.model = hf.model  # the same module: only the decode loop differs
    return {"transformers": hf}, {"transformers": generate} | ({"hf-forward": hf} if args.hf_forward else {}), []


def main() -> None:
    args = parse_args()
    global clock
    clock = CLOCK[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    from nebula_engine.config import resolve_model

    limit, read_gbs = gemm_gflops(), read_limit_gbs()
    with tempfile.TemporaryDirectory(prefix="nebula-bench-") as tmp:
        checkpoint = resolve_model(args.model) if args.model else make_checkpoint(args, tmp)
        ours = OursRunner(checkpoint, args)
        model, config = ours.engine.model_runner.model, ours.engine.model_config
        vocab = config.vocab_size
        weights, attention = matmul_weights_per_token(model), attention_flops_per_context_token(model)
        step_bytes = weight_bytes_per_step(model)
        prefill_peers, decode_peers, to_close = build_peers(args, checkpoint)
        peer_name = next(iter(prefill_peers))
        header = (f"{args.model or args.family}: hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
                  f"{weights / 1e6:.1f} M matmul weights per token ({step_bytes / 1e6:.0f} MB as stored, "
                  f"{args.quantization}), {torch.get_num_threads()} threads, {args.clock} clock")
        print(f"{header}; GEMM limit (2048^3) {limit:.1f} GFLOP/s, memory-read limit {read_gbs:.1f} GB/s", flush=True)

        head = model.lm_head.weight.numel()

        def fraction(tokens_per_s: float, context: float, logits_per_token: float = 1.0) -> str:
            """``logits_per_token``: the share of tokens whose logits are computed (a prefill: only its last)."""
            gflops = tokens_per_s * (2 * (weights - head + head * logits_per_token) + attention * context) / 1e9
            return f"{gflops:6.1f} GFLOP/s = {100 * gflops / limit:4.1f}% of limit"

        def bandwidth(steps_per_s: float) -> str:
            gbs = steps_per_s * step_bytes / 1e9
            return f"{gbs:6.1f} GB/s = {100 * gbs / read_gbs:4.1f}% of limit"

        warm = random_prompts(1, 16, vocab, seed=0)
        for runner in [ours, *prefill_peers.values(), *decode_peers.values()]:
            runner.prefill(warm)
            runner.decode(warm, 2)
        page_rows = []
        for tokens in args.prompt_len:
            prefill = best_of({"ours": ours} | prefill_peers, args.repeats,
                              lambda r, i: r.prefill(random_prompts(1, tokens, vocab, seed=1 + i)))
            context = (tokens + 1) / 2  # causal: a token sees half on average
            ours_rate, peer_rate = tokens / prefill["ours"], tokens / prefill[peer_name]
            kind = " (forward)" if args.peer == "transformers" else ""
            page_rows.append((f"prefill, {tokens} tokens", f"{ours_rate:.1f}",
                              limit_share(fraction(ours_rate, context, 1 / tokens)), f"{peer_rate:.1f}{kind}",
                              f"{ours_rate / peer_rate:.2f}x"))
            print(f"prefill {tokens} tokens       ours {ours_rate:8.1f} tok/s "
                  f"({fraction(ours_rate, context, 1 / tokens)})   {peer_name} {peer_rate:8.1f} tok/s "
                  f"({fraction(peer_rate, context, 1 / tokens)})   ours/{peer_name} {ours_rate / peer_rate:.2f}x",
                  flush=True)
        context = args.decode_prompt_len + args.decode_steps / 2
        for batch in args.decode_batches:
            seconds = best_of({"ours": ours} | decode_peers, args.repeats, lambda r, i: r.decode(
                random_prompts(batch, args.decode_prompt_len, vocab, seed=100 + i), args.decode_steps))
            rates = {name: batch / step for name, step in seconds.items()}
            ratio = rates["ours"] / rates[peer_name]
            line = (f"decode {batch:3d} x {args.decode_prompt_len} prompt   ours {rates['ours']:8.1f} tok/s "
                    f"({fraction(rates['ours'], context)}; {bandwidth(1 / seconds['ours'])})   "
                    f"{peer_name} {rates[peer_name]:8.1f} tok/s ({bandwidth(1 / seconds[peer_name])})   "
                    f"ours/{peer_name} {ratio:.2f}x")
            if "hf-forward" in rates:
                line += (f"   HF forward {rates['hf-forward']:8.1f} tok/s, "
                         f"ours/HF forward {rates['ours'] / rates['hf-forward']:.2f}x")
            print(line, flush=True)
            share = (limit_share(fraction(rates["ours"], context)) if args.peer == "transformers"
                     else limit_share(bandwidth(1 / seconds["ours"])) + " (memory)")
            kind = " (generate)" if args.peer == "transformers" else ""
            page_rows.append((f"decode, {batch} requests x {args.decode_prompt_len} prompt tokens",
                              f"{rates['ours']:.1f}", share, f"{rates[peer_name]:.1f}{kind}", f"{ratio:.2f}x"))
        for runner in to_close:
            runner.close()
    end_limit = gemm_gflops()
    print(f"GEMM limit again at the end: {end_limit:.1f} GFLOP/s (the machine's load changed by this much)")
    if args.write_docs:
        from nebula_engine.bench.results_page import write_page

        page = engine_speed_page(args.peer, args.model, header, page_rows, (limit, end_limit), read_gbs)
        print(f"wrote {write_page(page)}")


if __name__ == "__main__":
    main()

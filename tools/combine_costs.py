"""Measure each PIC backend's combine cost on models shaped like the paper's four (layer count, attention
type, MoE), for the shipped GPU profiles' ``combine_cost``.

The GPU profiles keep public specs for throughput, but what a combine costs relative to a prefill depends on the
backend and on the model's structure (CacheBlend and A3 recompute every token at their check layer, so the
fewer layers a model has, the dearer they are). This builds small random checkpoints with the paper models'
layer structure (hidden size shrunk so a CPU can run them), runs ``nebula-engine profile``'s combine measurement
on each, and prints each backend's combine time over a plain prefill of the same prompt; ``--write`` stores them in
the shipped profiles.

    python tools/combine_costs.py                 # prints the table
    python tools/combine_costs.py --write         # and updates nebula_engine/cluster/control/profiles/*.json
    python tools/combine_costs.py --write --add prophet   # adds one backend's cost, keeping the others
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from nebula_engine.bench.profile import EngineProbe, ProfileOptions, combine_costs, measure_combines
from nebula_engine.model.tiny import cached_checkpoint

PROFILES = Path(__file__).resolve().parent.parent / "nebula_engine" / "cluster" / "control" / "profiles"
SMALL = dict(hidden_size=256, num_attention_heads=8, head_dim=32, intermediate_size=768, max_position_embeddings=8192)
# profile file -> (checkpoint name, tiny family, the paper model's layer structure)
SHAPES = {
    "default.json": ("paper-mistral-7b", "mistral", dict(SMALL, num_hidden_layers=32, num_key_value_heads=2)),
    "deepseek-v2-lite.json": ("paper-deepseek-v2-lite", "deepseek_v2",
                              dict(SMALL, num_hidden_layers=27, head_dim=None, intermediate_size=768)),
    "qwen3-30b-a3b.json": ("paper-qwen3-30b-a3b", "qwen3_moe", dict(SMALL, num_hidden_layers=48, num_key_value_heads=2)),
    "qwen3.5-35b-a3b.json": ("paper-qwen3.5-35b-a3b", "qwen3_5_moe",
                             dict(SMALL, num_hidden_layers=40, num_key_value_heads=2,
                                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10)),
}
LAYERS_NOTE = {"default.json": "32 layers", "deepseek-v2-lite.json": "27 layers (MLA + MoE)",
               "qwen3-30b-a3b.json": "48 layers (MoE)", "qwen3.5-35b-a3b.json": "40 layers, 1 in 4 full attention (MoE)"}


def checkpoint(name: str, family: str, shape: dict) -> str:
    overrides = {k: v for k, v in shape.items() if v is not None}
    return str(cached_checkpoint(name, family, **overrides))


def measure(model: str, repeats: int) -> tuple[dict[str, float], str]:
    probe = EngineProbe(ProfileOptions(model=model, repeats=repeats))
    rows = measure_combines(probe)
    detail = "; ".join(f"{row['backend']} {row['seconds'] * 1e3:.0f}" for row in rows)
    return combine_costs(rows), detail


def row_ms(detail: str, backend: str) -> str:
    """One backend's milliseconds from ``measure``'s detail ("plain prefill 746; epic 169; ...")."""
    return next(item.split()[-1] for item in detail.split("; ") if item.split()[0] == backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="store the costs in the shipped profiles")
    parser.add_argument("--only", default=None, help="comma-separated profile files to measure")
    parser.add_argument("--add", default=None,
                        help="comma-separated backends: --write stores only their costs, each beside the others "
                             "already stored, and notes the run they come from")
    args = parser.parse_args()
    for profile_file, (name, family, shape) in SHAPES.items():
        if args.only and profile_file not in args.only.split(","):
            continue
        costs, detail = measure(checkpoint(name, family, shape), args.repeats)
        print(f"{profile_file:<24} {family:<12} {costs}  (single-core ms: {detail})", flush=True)
        if not args.write:
            continue
        added = {backend: cost for backend, cost in costs.items() if backend in args.add.split(",")} if args.add else costs
        if not added:
            continue
        path = PROFILES / profile_file
        data = json.loads(path.read_text())
        data["combine_cost"] = {**data["combine_cost"], **added}
        today = time.strftime('%Y-%m-%d')
        if args.add:
            plain = detail.split(";")[0]  # "plain prefill N"
            data["sources"]["combine_cost"] += "; " + ", ".join(
                f"{backend} added {today} by tools/combine_costs.py --add {backend} (same procedure, its own run; "
                f"single-core ms: {plain}; {backend} {row_ms(detail, backend)})" for backend in added)
        else:
            data["sources"]["combine_cost"] = (
                f"MEASURED by tools/combine_costs.py ({today}, fp32 CPU): nebula-engine profile's "
                f"combine measurement on a random {family} checkpoint with the paper model's structure, "
                f"{LAYERS_NOTE[profile_file]}, hidden 256; 4 cached segments x 256 + 32-token query, CPU time of "
                f"each backend's combine over a plain prefill of the same prompt (single-core ms: {detail}). Throughput stays "
                "from public specs; this ratio is taken to carry over to the GPU")
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

"""How close a selective-recompute backend comes to an oracle's choice of tokens, on a real model.

CacheBlend recomputes the reused tokens whose K/V moved most at one check layer. An oracle knows what only a full
prefill of the prompt knows and ranks the reused tokens by it; both then recompute the same share of them through
the same machinery (CacheBlend's: check layer 1, each document's first ``sink`` tokens inside the budget), so the
rows differ only in which tokens were chosen. Oracle rankings:
  - ``oracle-deviation``: every attention layer's true K and V error of the token (placed K/V against the full
    prefill's), squared, relative to the full prefill's mean squared K and V norm in that layer, summed;
  - ``oracle-impact``: per layer, the attention the question's tokens pay the token in the full prefill times its
    true V error, per head (the first-order change of what the question reads), relative to the layer's mean V
    norm, summed over layers.
A ranking that beats CacheBlend's shows what a better selection rule could reach; an oracle that misses the goal
at a given share bounds every rule that only chooses tokens. ``--through-layer C`` ranks by layers 0..C only:
what a rule could compute with check layer C, where every row has been recomputed through C (so placed and
fresh K/V, and the question's attention, are the full prefill's there).

    python tools/pic_oracle.py --doc-sentences 12 --ratio 0.15 --ratio 0.2 --num-prompts 20 --threads 2
    python tools/pic_oracle.py --doc-sentences 12 --ratio 0.2 --through-layer 1 --through-layer 3

Rows are those of ``pic_quality_rag`` (KL and top-1 against PIC off, 20-token match, accuracy, time).
``--write-docs [PAGE]`` also writes the results page docs/results/PAGE.md (default ``pic-oracle``) with its plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from pic_quality import PICHarness
from pic_quality_rag import ChatPrompt, finish, measure, reference_prompts
from nebula_engine.kernels.attention import AttentionContext
from nebula_engine.pic.backends.cacheblend import CacheBlend

ORACLES = ("oracle-deviation", "oracle-impact")
PAGE_ABOUT = ("CacheBlend recomputes the reused tokens whose K/V moved most at its check layer. Two oracles rank the "
              "reused tokens by what only a full prefill knows (`oracle-deviation`: every layer's true K and V error; "
              "`oracle-impact`: the question's attention times the true V error) and recompute the same share "
              "through CacheBlend's machinery, so the rows differ only in which tokens were chosen. An oracle that "
              "misses a quality level at a given share bounds every rule that only chooses tokens. The prompts are "
              "those of the PIC quality page (invented facts in `<pic>` documents, asked in another order).")


@dataclass(frozen=True)
class RankedBlend(CacheBlend):
    """CacheBlend that ranks the reused tokens by ``scores`` (one per prompt position) instead of by the deviation
    at its check layer; everything else (rows through the check layer, sink heads, budget) is CacheBlend's."""

    scores: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def select(self, layer_idx, run, rows, before, recorded):
        reused = self.reused_rows(run, rows)
        if reused.numel() == 0:
            return torch.arange(rows.numel(), device=rows.device)
        return self.keep(run, rows, self.scores.to(rows.device)[reused],
                         self._ratios()[self.check_layers.index(layer_idx)])


@dataclass
class _QueryRecorder(AttentionContext):
    """Keeps each attention layer's post-RoPE queries of the last ``last`` rows, and the layer's scale."""

    last: int = 1
    queries: dict = field(default_factory=dict)

    def attend(self, layer_idx, q, k, v, scale, sliding_window=None):
        self.queries[layer_idx] = (q[-self.last:].float().clone(), scale)
        return super().attend(layer_idx, q, k, v, scale, sliding_window)


@torch.inference_mode()
def question_attention(harness: PICHarness, token_ids: list[int], num_question: int) -> list[torch.Tensor]:
    """Per attention layer, [H, M, N]: the full prefill's attention probabilities of the prompt's last
    ``num_question`` rows over all N positions (causal)."""
    n = len(token_ids)
    table = harness.allocate(n)
    try:
        made: list[_QueryRecorder] = []

        def recording(*parts) -> _QueryRecorder:
            made.append(_QueryRecorder(*parts, last=num_question))
            return made[-1]

        harness.forward(token_ids, table, 0, context_type=recording)
        rows = torch.arange(n - num_question, n)
        future = torch.arange(n)[None, :] > rows[:, None]  # [M, N]
        probabilities = []
        for attn_idx in range(len(harness.attention_layer_indices())):
            queries, scale = made[0].queries[attn_idx]
            keys, _ = harness.read_kv(attn_idx, table, n)
            keys = keys.repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)
            logits = torch.einsum("mhd,nhd->hmn", queries, keys.to(queries.device)) * scale
            probabilities.append(logits.masked_fill(future.to(logits.device), float("-inf")).softmax(-1))
        return probabilities
    finally:
        harness.release(table)


def relative_errors(errors: torch.Tensor, sizes: torch.Tensor, reused: torch.Tensor) -> torch.Tensor:
    """[L, N] errors over [L, N] sizes of the full prefill's own K/V -> [N]: each layer's errors divided by the mean
    size there over the ``reused`` positions ([N] bool), summed over layers; 0 elsewhere (rows the combine computes
    anyway: their placed K/V is whatever the pages held before). A layer whose placed K/V is exact (layer 0 after
    re-rotation) adds nothing."""
    mean_size = (sizes * reused).sum(dim=1, keepdim=True) / reused.sum().clamp_min(1)
    return (errors * reused / mean_size.clamp_min(1e-30)).sum(dim=0)


def deviation_scores(keys: list[torch.Tensor], values: list[torch.Tensor], ref_keys: list[torch.Tensor],
                     ref_values: list[torch.Tensor], reused: torch.Tensor) -> torch.Tensor:
    """[N] oracle-deviation from per layer K and V [N, Hkv, D] (placed) and the full prefill's: squared errors
    relative to the full prefill's squared norms, K and V."""
    def squared(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([row.pow(2).flatten(1).sum(-1) for row in rows])

    key_errors = squared([k - r for k, r in zip(keys, ref_keys)])
    value_errors = squared([v - r for v, r in zip(values, ref_values)])
    return (relative_errors(key_errors, squared(ref_keys), reused)
            + relative_errors(value_errors, squared(ref_values), reused))


def impact_scores(values: list[torch.Tensor], ref_values: list[torch.Tensor], attention: list[torch.Tensor],
                  reused: torch.Tensor) -> torch.Tensor:
    """[N] oracle-impact: per layer, sum over heads and question rows of attention [H, M, N] times the token's V
    error in that head's KV group, relative to the full prefill's V norms."""
    impacts, sizes = [], []
    for value, ref, probabilities in zip(values, ref_values, attention):
        heads = probabilities.shape[0]
        error = (value - ref).norm(dim=-1).repeat_interleave(heads // ref.shape[1], dim=1)  # [N, H]
        impacts.append((probabilities.sum(dim=1) * error.t().to(probabilities.device)).sum(dim=0))
        sizes.append(ref.norm(dim=-1).sum(dim=1).to(probabilities.device) * (heads // ref.shape[1]))
    return relative_errors(torch.stack(impacts), torch.stack(sizes), reused)


@torch.inference_mode()
def oracle_rankings(harness: PICHarness, prompt: ChatPrompt, reference_table: torch.Tensor,
                    throughs: list[int | None]) -> dict[int | None, dict[str, torch.Tensor]]:
    """Per entry of ``throughs`` (None: every layer), each oracle's [N] scores for ``prompt`` from attention layers
    0..through: the documents placed as the combine places them, against the full prefill's K/V in
    ``reference_table``. The forward, the placement and the K/V reads run once for all of them."""
    segmented = prompt.segmented
    ids, n = list(segmented.token_ids), len(segmented.token_ids)
    attention = question_attention(harness, ids, n - segmented.pic_segments[-1].end)
    table = harness.allocate(n)
    try:  # every CacheBlend ratio shares one cache format: the placed K/V does not depend on it
        run = harness.combine_run(CacheBlend(), segmented, table)  # documents placed (prefilled alone on a miss)
        placed = [harness.read_kv(i, table, n) for i in range(len(harness.attention_layer_indices()))]
        full = [harness.read_kv(i, reference_table, n) for i in range(len(placed))]
    finally:
        harness.release(table)
    reused = torch.zeros(n, dtype=torch.bool)
    reused[sorted(run.layout.reused_position_set)] = True
    rankings = {}
    for through in throughs:
        layers = slice(0, None if through is None else through + 1)
        keys, values = [k for k, _ in placed[layers]], [v for _, v in placed[layers]]
        ref_keys, ref_values = [k for k, _ in full[layers]], [v for _, v in full[layers]]
        rankings[through] = {"oracle-deviation": deviation_scores(keys, values, ref_keys, ref_values, reused),
                             "oracle-impact": impact_scores(values, ref_values, attention[layers], reused)}
    return rankings


def label(name: str, ratio: float, through: int | None) -> str:
    return f"{name}:ratio={ratio}" + ("" if through is None or name == "cacheblend" else f",layers=0-{through}")


def evaluate(harness: PICHarness, ratios: list[float], num_prompts: int, seed: int, detail_sentences: int,
             throughs: list[int | None] = (None,),
             log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> dict:
    """Per prompt, CacheBlend and each oracle (ranking by the layers up to each of ``throughs``, None: all) at each
    ratio: ``pic_quality_rag.measure`` rows."""
    labels = [label(name, ratio, through) for ratio in ratios for name in ("cacheblend", *ORACLES)
              for through in (throughs if name != "cacheblend" else [None])]
    rows: dict[str, list[dict]] = {name: [] for name in labels}
    off = []
    for index, (prompt, reference, pic_off) in enumerate(reference_prompts(harness, num_prompts, seed,
                                                                             detail_sentences)):
        off.append(pic_off)
        rankings = oracle_rankings(harness, prompt, reference.block_table, throughs)
        for ratio in ratios:
            backends = {label("cacheblend", ratio, None): CacheBlend(ratio=ratio)}
            for through, scored in rankings.items():
                backends.update({label(name, ratio, through): RankedBlend(ratio=ratio, scores=scores)
                                 for name, scores in scored.items()})
            for name in labels:
                if name in backends:
                    rows[name].append(measure(harness, backends[name], prompt, reference, reference.prefill_seconds))
        log(f"prompt {index + 1}/{num_prompts}: " + ", ".join(
            f"{name} KL {rows[name][-1]['kl_next']:.3f}" for name in labels))
    return {"pic_off": off, "rows": rows}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default="smollm2", help="an attention-only model the engine loads")
    parser.add_argument("--ratio", type=float, action="append",
                        help="share of reused tokens recomputed (repeat for several; default 0.15)")
    parser.add_argument("--through-layer", type=int, action="append",
                        help="rank by attention layers 0..C only, as a rule with check layer C could (repeat for "
                             "several; default: every layer)")
    parser.add_argument("--doc-sentences", type=int, default=0, help="background sentences per document, 0 to 12")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--png", help="write the plot here (KL and top-1 against the recomputed share)")
    parser.add_argument("--out", help="write the report JSON here")
    parser.add_argument("--write-docs", nargs="?", const="pic-oracle", default=None, metavar="PAGE",
                        help="also write the results page docs/results/PAGE.md and its plot (default PAGE: pic-oracle)")
    args = parser.parse_args(argv)
    args.ratio = args.ratio or [0.15]
    if any(not 0.0 < r <= 1.0 for r in args.ratio):
        parser.error(f"--ratio must be in (0, 1], got {args.ratio}")
    if any(c < 0 for c in args.through_layer or []):
        parser.error(f"--through-layer must be a layer index >= 0, got {args.through_layer}")
    if args.num_prompts < 1:
        parser.error(f"--num-prompts must be at least 1, got {args.num_prompts}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    harness = PICHarness(args.model, num_pages=400 if not args.doc_sentences else 1600, page_size=args.page_size)
    if harness.has_linear_attention or any(layer.latent_rope_dim is not None
                                           for layer in harness.model.attention_layers()):
        raise SystemExit("pic_oracle ranks by K/V errors of attention-only, non-MLA models")
    num_layers = len(harness.attention_layer_indices())
    if any(c >= num_layers for c in args.through_layer or []):
        raise SystemExit(f"--through-layer: {args.model} has {num_layers} attention layers, got {args.through_layer}")
    measured = evaluate(harness, args.ratio, args.num_prompts, args.seed, args.doc_sentences,
                        args.through_layer or [None])
    report = finish({"model": args.model, "segment_sink": harness.executor.bos_token_id, "seed": args.seed,
                     "detail_sentences": args.doc_sentences, **measured}, args.markdown, args.png, args.write_docs,
                    "PIC token selection against an oracle", PAGE_ABOUT)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

"""Quality of each PIC backend against full prefill of the same prompt (spec B6's model-free proxies).

Prompts are shaped like RAGPulse: system prompt + documents (PIC segments) + question. The documents are
cached alone in one order (as an earlier request would have), then combined in a permuted order, so every
reused segment is re-rotated to new positions. For each backend, against a plain prefill of the same tokens:
  - KL(p_full || p_pic) of the next-token distribution at the last prompt position;
  - top-1 agreement over a continuation: full prefill's greedy continuation, teacher-forced on both sides
    (same prefix at each step, argmax compared per step), and the mean KL over those steps;
  - per-layer deviation ||X - X_full||_F / ||X_full||_F over the prompt's tokens of post-RoPE K and V
    (MLA: k_pe and the latent c̃); for linear-attention layers the recurrent state after the prompt, ||S - S_full||;
  - recomputed tokens (reused tokens whose K/V was recomputed) and the backend's cost estimate as a share
    of a full prefill (``combine_cost`` / tokens computed).
Random-weight tiny models have no trained attention sinks (spec B6 caveat): they check the machinery, not the
quality trend; pass --model with a local checkpoint of real weights for that.

    python tools/pic_quality.py                                    # tiny mistral (5 backends) + tiny qwen3_5 (hypic)
    python tools/pic_quality.py --family qwen3 --hidden-size 512 --layers 8 --num-docs 8 --doc-len 256
    python tools/pic_quality.py --model ~/models/Mistral-7B-Instruct-v0.2 --backend epic --backend epic:k=32
    python tools/pic_quality.py --model smollm2 --num-prompts 20 --markdown q.md --png q.png   # fictional facts
    python tools/pic_quality.py --summary pic-quality pic-quality-qwen0.5b pic-quality-qwen1.5b  # by model size

With ``--model`` the prompts are chats over invented facts (``--prompts facts``, see pic_quality_rag.py): answer
accuracy, 20-token match and combine time are measured too. ``--prompts random`` keeps random token prompts.

The combine runs the engine's own pieces below the scheduler (``PICHarness``): the PIC store and its segment
prefill, ``place_reused_kv`` and the backend's ``combine``, each prompt into pages of its own.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from nebula_engine.config import EngineConfig
from nebula_engine.engine.llm_engine import LLMEngine
from nebula_engine.kernels.attention import AttentionContext, AttentionMetadata
from nebula_engine.model.tiny import TINY_FAMILIES, make_tiny_checkpoint
from nebula_engine.pic.backends import PICBackend, resolve_pic_backend
from nebula_engine.pic.backends.base import has_linear_attention
from nebula_engine.pic.combine import CachedSegment, CombineRun, place_reused_kv
from nebula_engine.pic.layout import CombineLayout
from nebula_engine.pic.segments import SegmentedPrompt, segment_token_lists

ATTENTION_BACKENDS = ("full", "naive", "epic", "cacheblend", "a3", "prophet")
EXACT_HYPIC = "hypic:seam=1000000"  # every reused token recomputed: hypic's own exactness check
HYBRID_BACKENDS = (EXACT_HYPIC, "hypic")
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")
CAVEAT = ("caveat (spec B6): random-weight tiny models have no trained attention sinks, so EPIC's motivation "
          "(re-computing each segment's sink-like first tokens) does not show and the ranking of backends "
          "says little about real models; use --model with real weights for quality trends.")


# ---------------------------------------------------------------- models


@dataclass(frozen=True)
class TinyModel:
    """A random checkpoint of ``family`` scaled from hidden size and layer count (as tools/bench_forward.py)."""

    family: str
    hidden_size: int
    num_layers: int
    num_heads: int = 8
    num_kv_heads: int = 2
    init_std: float = 0.02
    max_positions: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in TINY_FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; choose from {', '.join(TINY_FAMILIES)}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden size {self.hidden_size} / {self.num_heads} heads / {self.num_kv_heads} kv heads "
                             f"must divide evenly")
        if self.family in HYBRID_FAMILIES and self.num_layers % 4:
            raise ValueError("qwen3_5 needs a multiple of 4 layers (3 linear-attention + 1 full-attention)")

    def overrides(self) -> dict:
        hidden, heads = self.hidden_size, self.num_heads
        head_dim = hidden // heads
        settings = dict(hidden_size=hidden, num_hidden_layers=self.num_layers, num_attention_heads=heads,
                        num_key_value_heads=self.num_kv_heads, head_dim=head_dim,
                        intermediate_size=int(3.5 * hidden), max_position_embeddings=self.max_positions,
                        initializer_range=self.init_std)
        moe = dict(num_experts_per_tok=4, moe_intermediate_size=hidden // 2)
        if self.family == "deepseek_v2":
            settings.update(moe, num_key_value_heads=None, kv_lora_rank=hidden // 4, qk_nope_head_dim=head_dim,
                            qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim, n_routed_experts=16,
                            n_shared_experts=2)
        elif self.family in HYBRID_FAMILIES:
            half = head_dim // 8  # RoPE on a quarter of the head, split over 3 MRoPE rows
            settings.update(
                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (self.num_layers // 4),
                linear_num_key_heads=heads // 2, linear_num_value_heads=heads, linear_key_head_dim=head_dim,
                linear_value_head_dim=head_dim,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
                                 "mrope_interleaved": True})
            if self.family == "qwen3_5_moe":
                settings.update(moe, num_experts=16, shared_expert_intermediate_size=hidden // 2)
        return settings

    def write(self, out_dir: str | Path) -> str:
        return str(make_tiny_checkpoint(self.family, out_dir, seed=self.seed, **self.overrides()))

    def describe(self) -> str:
        return f"tiny {self.family} (random, hidden {self.hidden_size}, {self.num_layers} layers, init {self.init_std})"


# ---------------------------------------------------------------- prompts


@dataclass(frozen=True)
class PromptShape:
    system_len: int = 64
    num_docs: int = 6
    doc_len: int = 128
    question_len: int = 32

    def __post_init__(self) -> None:
        if min(self.num_docs, self.doc_len, self.question_len) < 1 or self.system_len < 0:
            raise ValueError(f"prompt shape needs >= 1 document of >= 1 token and a question: {self}")

    @property
    def max_tokens(self) -> int:
        return self.system_len + self.num_docs * self.doc_len + self.question_len + 1  # + a possible BOS


@dataclass(frozen=True)
class RagPrompt:
    """System prompt, documents (PIC segments) in ``order``, question; the documents were cached in index order."""

    system: tuple[int, ...]
    docs: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]
    question: tuple[int, ...]

    def segments(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("regular", self.system)] + [("pic", self.docs[i]) for i in self.order] + [("regular", self.question)]

    @classmethod
    def random(cls, shape: PromptShape, vocab: tuple[int, int], seed: int) -> RagPrompt:
        """Random token ids in ``vocab`` [low, high); documents permuted (never in their cached order)."""
        rng = random.Random(seed)

        def tokens(n: int) -> tuple[int, ...]:
            return tuple(rng.randrange(*vocab) for _ in range(n))

        order = list(range(shape.num_docs))
        while shape.num_docs > 1 and order == sorted(order):
            rng.shuffle(order)
        return cls(tokens(shape.system_len), tuple(tokens(shape.doc_len) for _ in range(shape.num_docs)),
                   tuple(order), tokens(shape.question_len))


# ---------------------------------------------------------------- harness


class PICHarness:
    """An engine's model, KV pool and PIC store, driven below the scheduler.

    A plain prefill and each backend's combine of the same prompt fill pages of their own (``allocate``), which
    stay readable until ``release``. ``combine_run`` does what ``PICExecutor.run`` does before the backend runs:
    look each PIC segment up in the store (prefilling it alone on a miss), place and re-rotate its K/V.
    Prefix caching is off: every prompt starts at position 0 (HYPIC needs that).
    """

    def __init__(self, checkpoint: str, num_pages: int, page_size: int = 16):
        self.engine = LLMEngine(EngineConfig.create(checkpoint, page_size=page_size, num_pages=num_pages,
                                                    enable_prefix_caching=False))
        runner = self.engine.model_runner
        self.model, self.storage, self.executor = runner.model, runner.kv_storage, runner.pic_executor
        self.pool = self.engine.cache_store.pool
        self.page_size = page_size

    @property
    def has_linear_attention(self) -> bool:
        return has_linear_attention(self.model)

    def vocab_range(self) -> tuple[int, int]:
        """Ordinary token ids: past the low specials, inside both the tokenizer's base vocab and the model's."""
        high = min(self.engine.tokenizer.hf.vocab_size, self.engine.model_config.vocab_size)
        return min(100, high // 2), high

    def segmented(self, prompt: RagPrompt) -> SegmentedPrompt:
        prefix = self.engine.tokenizer.prompt_prefix_ids  # BOS where the tokenizer adds one
        return segment_token_lists(prompt.segments(), prefix[0] if len(prefix) == 1 else None)

    def backend(self, spec: str) -> PICBackend:
        return resolve_pic_backend(spec, self.model)

    # pages and forward passes

    def allocate(self, num_tokens: int) -> torch.Tensor:
        """A block table [pages] for ``num_tokens``; ``release`` it."""
        pages = self.pool.allocate(-(-num_tokens // self.page_size))
        return torch.tensor(pages, dtype=torch.int64, device=self.device)

    def release(self, block_table: torch.Tensor) -> None:
        self.pool.release(block_table.tolist())

    @property
    def device(self) -> torch.device:
        return self.storage.layer_caches[0][0].device

    def slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return block_table[positions // self.page_size] * self.page_size + positions % self.page_size

    @torch.inference_mode()
    def forward(self, token_ids: list[int], block_table: torch.Tensor, start: int, states=None,
                context_type: Callable[..., AttentionContext] = AttentionContext):
        """Tokens at positions [start, start + T) after ``start`` cached ones -> (final hidden [T, Hd], states).

        ``states``: per linear-attention layer, the state after position ``start`` (None at the start).
        ``context_type``: builds the attention context from (backend, metadata, caches, MLA backend)."""
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        positions = torch.arange(start, start + ids.numel(), device=self.device)
        meta = AttentionMetadata(query_start_loc=[0, ids.numel()], seq_lens=[start + ids.numel()],
                                 block_tables=block_table[None], slot_mapping=self.slots(block_table, positions),
                                 page_size=self.page_size)
        runner = self.engine.model_runner
        ctx = context_type(runner.attention_backend, meta, self.storage.layer_caches, runner.mla_backend)
        if not self.has_linear_attention:
            return self.model.forward(ids, positions, ctx), None
        hidden, new_states = self.model.forward_with_states(
            ids, positions, ctx, None if states is None else [[state] for state in states])
        return hidden, [layer[0] for layer in new_states]

    def warm(self, backend: PICBackend, prompt: RagPrompt) -> None:
        """Cache ``prompt``'s documents in the store, in their cached (index) order, each alone or behind the
        system prompt (the backend's ``context``)."""
        segmented = self.segmented(prompt)
        context = self.executor.segment_context(backend, segmented.token_ids, segmented.pic_segments)
        for doc in prompt.docs:
            entry = self.executor.lookup_or_prefill(backend, doc, context)
            if entry is None:
                raise RuntimeError("the KV pool has no room to cache the documents: raise num_pages")
            self.executor.cache.pic.unlock(entry)

    @torch.inference_mode()
    def combine_run(self, backend: PICBackend, segmented: SegmentedPrompt, block_table: torch.Tensor) -> CombineRun:
        """A ``CombineRun`` of ``segmented`` into ``block_table``'s pages, reused K/V placed (PICExecutor.run)."""
        pic_segments, num_tokens = segmented.pic_segments, len(segmented.token_ids)
        context = self.executor.segment_context(backend, segmented.token_ids, pic_segments)
        cached, locked = {}, []
        try:
            for index, segment in enumerate(pic_segments):
                found = self.executor.lookup_or_prefill(backend, segmented.segment_ids(segment), context)
                if found is not None:
                    locked.append(found)
                    cached[index] = CachedSegment(found.pages, found.num_tokens, found.state)
            layout = CombineLayout.plan(num_tokens, 0, [(s.start, s.length) for s in pic_segments],
                                        [i in cached for i in range(len(pic_segments))])
            runner = self.engine.model_runner
            run = CombineRun(self.model, torch.tensor(segmented.token_ids, device=self.device), layout,
                             block_table, self.page_size, self.storage.layer_caches, runner.attention_backend,
                             runner.mla_backend, cached)
            place_reused_kv(run)
        finally:
            for found in locked:
                self.executor.cache.pic.unlock(found)
        return run

    # what the pages hold

    def attention_layer_indices(self) -> list[int]:
        """Decoder-layer index of each attention layer, in kv-cache order."""
        return [i for i, layer in enumerate(self.model.model.layers) if not layer.is_linear]

    def linear_layer_indices(self) -> list[int]:
        return [i for i, layer in enumerate(self.model.model.layers) if layer.is_linear]

    def read_kv(self, attn_idx: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) rows of positions [0, num_tokens): post-RoPE K and V, or MLA's k_pe and latent c̃."""
        slots = self.slots(block_table, torch.arange(num_tokens, device=self.device))
        tensors = self.storage.layer_caches[attn_idx]
        rope = self.model.attention_layers()[attn_idx].latent_rope_dim
        if rope is None:
            return tuple(t.view(-1, *t.shape[2:])[slots].float() for t in tensors)
        rows = tensors[0].view(-1, tensors[0].shape[-1])[slots].float()
        return rows[:, -rope:], rows[:, :-rope]


# ---------------------------------------------------------------- measurement


@dataclass(frozen=True)
class Reference:
    """Full prefill of a prompt, then its greedy continuation: logits [T, V] (row t predicts continuation[t])."""

    block_table: torch.Tensor
    logits: torch.Tensor
    continuation: list[int]
    states: list | None  # per linear-attention layer, after the prompt
    prefill_seconds: float = 0.0  # the prompt's plain prefill (one forward)


@torch.inference_mode()
def full_reference(harness: PICHarness, token_ids: list[int], steps: int) -> Reference:
    table = harness.allocate(len(token_ids) + steps)
    start = time.perf_counter()
    hidden, states = harness.forward(token_ids, table, 0)
    prefill_seconds = time.perf_counter() - start
    prompt_states = states
    logits = [harness.model.compute_logits(hidden[-1:])]
    continuation = [int(logits[-1].argmax())]
    for step in range(steps - 1):
        hidden, states = harness.forward(continuation[-1:], table, len(token_ids) + step, states)
        logits.append(harness.model.compute_logits(hidden))
        continuation.append(int(logits[-1].argmax()))
    return Reference(table, torch.cat(logits), continuation, prompt_states, prefill_seconds)


@torch.inference_mode()
def teacher_forced_logits(harness: PICHarness, first_hidden: torch.Tensor, reference: Reference,
                          num_prompt_tokens: int, block_table: torch.Tensor, states) -> torch.Tensor:
    """[T, V]: the prompt's last-position logits, then the continuation fed in one chunk after the prompt."""
    logits = [harness.model.compute_logits(first_hidden)]
    if len(reference.continuation) > 1:
        hidden, _ = harness.forward(reference.continuation[:-1], block_table, num_prompt_tokens, states)
        logits.append(harness.model.compute_logits(hidden))
    return torch.cat(logits)


def kl_per_row(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) per row, in fp64."""
    log_ref = reference_logits.double().log_softmax(-1)
    return (log_ref.exp() * (log_ref - logits.double().log_softmax(-1))).sum(-1).clamp_min(0.0)


def relative_deviation(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30))


@torch.inference_mode()
def measure_backend(harness: PICHarness, spec: str, prompt: RagPrompt, reference: Reference) -> dict:
    """One backend on one prompt: the metrics of the module doc."""
    backend = harness.backend(spec)
    harness.warm(backend, prompt)
    segmented = harness.segmented(prompt)
    num_tokens = len(segmented.token_ids)
    table = harness.allocate(num_tokens + len(reference.continuation))
    try:
        run = harness.combine_run(backend, segmented, table)
        result = backend.combine(run)
        logits = teacher_forced_logits(harness, result.hidden, reference, num_tokens, table, result.linear_states)
        kl = kl_per_row(reference.logits, logits)
        agree = (logits.argmax(-1) == torch.tensor(reference.continuation)).double()
        states = [{"layer": layer_idx, "state": relative_deviation(state.recurrent, ref.recurrent)}
                  for layer_idx, state, ref in zip(harness.linear_layer_indices(), result.linear_states or [],
                                                   reference.states or [])]
        return {"num_recomputed": result.num_recomputed, "num_reused": run.layout.num_reused,
                "cost_fraction": backend.combine_cost(run.layout, len(harness.model.model.layers))
                / run.layout.num_computed,
                "kl_next": float(kl[0]), "kl_continuation_mean": float(kl.mean()),
                "top1_first": bool(agree[0]), "top1_matches": int(agree.sum()), "steps": int(agree.numel()),
                "kv_deviation": kv_deviations(harness, reference.block_table, table, num_tokens),
                "state_deviation": states}
    finally:
        harness.release(table)


def kv_deviations(harness: PICHarness, reference_table: torch.Tensor, table: torch.Tensor,
                  num_tokens: int) -> list[dict]:
    """Per attention layer, the relative deviation of K and V (MLA: k_pe and latent) over the prompt."""
    rows = []
    for attn_idx, layer_idx in enumerate(harness.attention_layer_indices()):
        k_ref, v_ref = harness.read_kv(attn_idx, reference_table, num_tokens)
        k, v = harness.read_kv(attn_idx, table, num_tokens)
        rows.append({"layer": layer_idx, "key": relative_deviation(k, k_ref), "value": relative_deviation(v, v_ref)})
    return rows


def aggregate(spec: str, per_prompt: list[dict]) -> dict:
    """Means over prompts (top-1 agreement over all steps of all prompts)."""
    def mean(key):
        return sum(p[key] for p in per_prompt) / len(per_prompt)

    def layer_means(field: str, keys: tuple[str, ...]) -> list[dict]:
        rows = [p[field] for p in per_prompt]
        return [{"layer": layers[0]["layer"], **{k: sum(layer[k] for layer in layers) / len(layers) for k in keys}}
                for layers in zip(*rows)]

    steps = sum(p["steps"] for p in per_prompt)
    kv = layer_means("kv_deviation", ("key", "value"))
    return {"backend": spec, "num_recomputed": mean("num_recomputed"), "num_reused": mean("num_reused"),
            "cost_fraction": mean("cost_fraction"), "kl_next": mean("kl_next"),
            "kl_continuation_mean": mean("kl_continuation_mean"),
            "top1_agreement": sum(p["top1_matches"] for p in per_prompt) / steps,
            "top1_first_agreement": sum(p["top1_first"] for p in per_prompt) / len(per_prompt),
            "kv_deviation": kv, "state_deviation": layer_means("state_deviation", ("state",)),
            "key_deviation_mean": sum(r["key"] for r in kv) / len(kv),
            "value_deviation_mean": sum(r["value"] for r in kv) / len(kv),
            "per_prompt": [{k: p[k] for k in ("kl_next", "top1_matches", "steps", "num_recomputed")}
                           for p in per_prompt]}


def evaluate_model(harness: PICHarness, backends: list[str], shape: PromptShape, num_prompts: int,
                   steps: int, seed: int) -> list[dict]:
    per_backend: dict[str, list[dict]] = {spec: [] for spec in backends}
    for index in range(num_prompts):
        prompt = RagPrompt.random(shape, harness.vocab_range(), seed=seed + index)
        reference = full_reference(harness, list(harness.segmented(prompt).token_ids), steps)
        try:
            for spec in backends:
                per_backend[spec].append(measure_backend(harness, spec, prompt, reference))
        finally:
            harness.release(reference.block_table)
    return [aggregate(spec, results) for spec, results in per_backend.items()]


def pages_needed(shape: PromptShape, steps: int, page_size: int, num_formats: int = 2) -> int:
    """One prompt's documents cached in ``num_formats`` cache formats, the reference's and one backend's pages,
    BOS scratch. Older prompts' documents are evicted as needed (a miss is prefilled again, so it is only slower)."""
    doc_pages = -(-shape.doc_len // page_size)
    request_pages = -(-(shape.max_tokens + steps) // page_size)
    return shape.num_docs * doc_pages * num_formats + 2 * request_pages + 4


# ---------------------------------------------------------------- report


def deviation_by_layer(result: dict) -> str:
    """Per decoder layer: 'v' = V (MLA: latent) deviation of an attention layer, 's' = state of a linear one."""
    cells = {r["layer"]: f"v{r['value']:.2g}" for r in result["kv_deviation"]}
    cells.update({r["layer"]: f"s{r['state']:.2g}" for r in result["state_deviation"]})
    return " ".join(cells[i] for i in sorted(cells))


def format_table(runs: list[dict]) -> str:
    header = (f"{'model':<12} {'backend':<20} {'recomp':>11} {'cost':>5} {'KL next':>9} {'KL cont':>9} "
              f"{'top1':>5} {'K dev':>7} {'V dev':>7}  dev by layer")
    lines = [header, "-" * len(header)]
    for run in runs:
        for r in run["results"]:
            recomputed = f"{r['num_recomputed']:.0f}/{r['num_reused']:.0f}"
            lines.append(f"{run['model']['family']:<12} {r['backend']:<20} {recomputed:>11} {r['cost_fraction']:5.2f} "
                         f"{r['kl_next']:9.2e} {r['kl_continuation_mean']:9.2e} {r['top1_agreement']:5.2f} "
                         f"{r['key_deviation_mean']:7.3g} {r['value_deviation_mean']:7.3g}  {deviation_by_layer(r)}")
    return "\n".join(lines)


def legend(run: dict) -> str:
    p = run["prompt"]
    return (f"{run['model']['description']}: {run['num_prompts']} prompts of {p['num_tokens']} tokens "
            f"(system {p['system_len']}, {p['num_docs']} docs x {p['doc_len']}, question {p['question_len']}), "
            f"continuation {run['steps']} tokens")


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="a model the engine loads (checkpoint dir, .gguf, or a name such as smollm2); "
                             "default: a tiny random one")
    parser.add_argument("--prompts", choices=("facts", "random"), default=None,
                        help="facts: chat RAG prompts over invented facts (default with --model); random: random ids")
    parser.add_argument("--segment-sink", choices=("auto", "none"), default="auto",
                        help="facts: prefill each document behind the model's sink token (auto, the engine's "
                             "default) or alone (none: no sink before a document)")
    parser.add_argument("--doc-sentences", type=int, default=0,
                        help="facts: background sentences added to each document after its facts, 0 to 12 (12: "
                             "~270 tokens, RAGPulse's documents); 0: the two-sentence documents (~60 tokens)")
    parser.add_argument("--sweep", action="store_true",
                        help="facts: also run each named backend at the sweep settings of pic_quality_rag.SWEEPS "
                             "(recomputed share ~5-30%%)")
    parser.add_argument("--progress", default=None,
                        help="facts: after each prompt, write the rows so far here (JSON; --merge reads it)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="facts: only report: merge --out/--progress JSONs of runs over disjoint prompts (other "
                             "seeds) with the same specs into one table and plot")
    parser.add_argument("--markdown", default=None, help="facts: write the markdown table here")
    parser.add_argument("--png", default=None, help="facts: write the quality vs recomputed plot here")
    parser.add_argument("--write-docs", nargs="?", const="pic-quality", default=None, metavar="PAGE",
                        help="facts: also write the results page docs/results/PAGE.md and its plot (default PAGE: "
                             "pic-quality)")
    parser.add_argument("--summary", nargs="+", default=None, metavar="PAGE",
                        help="only report: one table over the PIC quality pages docs/results/PAGE.md (smallest model "
                             "first) with the goal checked, written to docs/results/pic-quality-by-size.md")
    parser.add_argument("--summary-backend", action="append", default=None,
                        help="--summary: a backend row to show per page, repeatable (default: cacheblend)")
    parser.add_argument("--page-note", action="append", default=None, metavar="TEXT",
                        help="facts: a note added to the --write-docs page (what the run left out, a related page), "
                             "repeatable")
    parser.add_argument("--family", default="mistral", choices=TINY_FAMILIES)
    parser.add_argument("--hybrid-family", default="qwen3_5", choices=(*HYBRID_FAMILIES, "none"),
                        help="also run hypic on this tiny hybrid model (none: skip; ignored with --model)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--init-std", type=float, default=0.1,
                        help="tiny models' initializer_range (HF's 0.02 leaves random logits so flat that top-1 "
                             "agreement is noise)")
    parser.add_argument("--num-docs", type=int, default=6)
    parser.add_argument("--doc-len", type=int, default=128)
    parser.add_argument("--system-len", type=int, default=64)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="continuation tokens compared (teacher-forced)")
    parser.add_argument("--backend", action="append", default=None,
                        help="backend spec, repeatable (default: full, naive, epic, cacheblend, a3; hybrids: hypic)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.num_prompts < 1:
        parser.error("--steps and --num-prompts must be >= 1")
    args.prompts = args.prompts or ("facts" if args.model else "random")
    if args.prompts == "facts" and not args.model:
        parser.error("--prompts facts needs --model with real weights (random models cannot answer)")
    if args.write_docs and args.prompts != "facts" and not args.merge:
        parser.error("--write-docs writes the fact-prompt results page: it needs --model (--prompts facts)")
    from fictional_facts import MAX_DETAIL_SENTENCES

    if not 0 <= args.doc_sentences <= MAX_DETAIL_SENTENCES:
        parser.error(f"--doc-sentences must be 0 to {MAX_DETAIL_SENTENCES}, got {args.doc_sentences}")
    return args


def evaluate_checkpoint(checkpoint: str, description: dict, backends: list[str] | None, shape: PromptShape,
                        args: argparse.Namespace) -> dict:
    harness = PICHarness(checkpoint, pages_needed(shape, args.steps, args.page_size), args.page_size)
    backends = backends or list(HYBRID_BACKENDS if harness.has_linear_attention else ATTENTION_BACKENDS)
    results = evaluate_model(harness, backends, shape, args.num_prompts, args.steps, args.seed)
    num_tokens = len(harness.segmented(RagPrompt.random(shape, harness.vocab_range(), args.seed)).token_ids)
    return {"model": description, "num_prompts": args.num_prompts, "steps": args.steps,
            "prompt": {**vars(shape), "num_tokens": num_tokens}, "results": results}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.summary:
        from pic_quality_summary import DEFAULT_BACKENDS, write_summary

        return {"page": str(write_summary(args.summary, tuple(args.summary_backend or DEFAULT_BACKENDS)))}
    if args.merge:
        from pic_quality_rag import merge

        return merge(args.merge, args.markdown, args.png, args.model, args.write_docs,
                     notes=tuple(args.page_note or ()))
    if args.prompts == "facts":
        from pic_quality_rag import run as run_facts

        report = run_facts(args.model, args.backend, args.num_prompts, args.seed, args.page_size, args.markdown,
                           args.png, sink=args.segment_sink == "auto", sweep=args.sweep,
                           detail_sentences=args.doc_sentences,
                           progress_path=args.progress, docs_page=args.write_docs,
                           notes=tuple(args.page_note or ()))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
        return report
    shape = PromptShape(args.system_len, args.num_docs, args.doc_len, args.question_len)
    runs = []
    if args.model:
        config = json.loads((Path(args.model).expanduser() / "config.json").read_text())
        description = {"family": config.get("model_type", "?"), "description": f"checkpoint {args.model}"}
        runs.append(evaluate_checkpoint(args.model, description, args.backend, shape, args))
    else:
        families = [args.family]
        if args.hybrid_family != "none" and args.family not in HYBRID_FAMILIES:
            families.append(args.hybrid_family)
        with tempfile.TemporaryDirectory(prefix="nebula-pic-quality-") as tmp:
            for family in families:
                tiny = TinyModel(family, args.hidden_size, args.layers, args.num_heads, args.num_kv_heads,
                                 args.init_std, max(4096, 2 * (shape.max_tokens + args.steps)), args.seed)
                checkpoint = tiny.write(Path(tmp) / family)
                backends = args.backend if family == args.family else None
                runs.append(evaluate_checkpoint(checkpoint, {"family": family, "description": tiny.describe()},
                                                backends, shape, args))
    report = {"caveat": CAVEAT if not args.model else None, "runs": runs}
    print(f"PIC quality vs full prefill, fp32, {torch.get_num_threads()} threads")
    for run in runs:
        print("  " + legend(run))
    print(format_table(runs))
    print("recomp = reused tokens recomputed / reused; cost = combine_cost / full prefill; KL in nats; "
          "dev = ||X - X_full|| / ||X_full|| over the prompt (v: V or MLA latent, s: linear-attention state)")
    if not args.model:
        print(CAVEAT)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()

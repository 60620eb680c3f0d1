"""PIC quality on a real model with RAG prompts over invented facts (``pic_quality.py --model smollm2``).

Each prompt is a chat (the model's own template): a system prompt, 4-6 documents about fictional organisations
(``fictional_facts``) in ``<pic>`` tags, and a question about one fact. The documents are cached alone in index
order, then the request lists them in another order, so every reused document is re-rotated. Per backend setting,
against PIC off (a plain prefill of the same token ids):
  - recomputed: reused tokens whose K/V was recomputed / reused tokens;
  - KL(p_off || p_pic) of the next token and top-1 agreement of that token; the same over the PIC-off reply's
    20 tokens teacher-forced (``tf``);
  - exact match of the 20 greedy tokens, and answer accuracy (the known fact appears in the 20-token reply);
  - combine time (placing the reused K/V and the backend's combine), as a share of the plain prefill's time.
Writes a markdown table and a PNG (next-token KL and top-1 against the recomputed share, one line per backend), and
with ``--write-docs [PAGE]`` the results page docs/results/PAGE.md (default ``pic-quality``) with its plot.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fictional_facts import FactPrompt
from pic_quality import PICHarness, full_reference, kl_per_row, teacher_forced_logits
from nebula_engine.bench.results_page import DOCS_RESULTS, ResultsPage, Table, invoked_command, write_page

REPLY_TOKENS = 20
DEFAULT_SPECS = ("full", "naive", "epic", "cacheblend", "a3", "prophet")
# per backend, settings besides its default whose recomputed share spans ~5-30% of the reused tokens on these
# prompts (documents of ~60 tokens: epic's default k=16 recomputes ~26%, k=4 ~7%)
SWEEPS = {"epic": ("epic:k=2", "epic:k=4", "epic:k=8"),
          "cacheblend": ("cacheblend:ratio=0.05", "cacheblend:ratio=0.3"),
          "a3": ("a3:ratio=0.05", "a3:ratio=0.3"),
          "prophet": ("prophet:ratio=0.1", "prophet:ratio=0.3")}
SWEEP_SPECS = tuple(spec for specs in SWEEPS.values() for spec in specs)


def with_sweep(specs: list[str]) -> list[str]:
    """``specs`` plus the sweep settings of each backend named there (a spec that names none is kept as is)."""
    out: list[str] = []
    for spec in specs:
        for item in (spec, *SWEEPS.get(spec.split(":")[0], ())):
            if item not in out:
                out.append(item)
    return out


@dataclass(frozen=True)
class ChatPrompt:
    """A fact prompt tokenized through the chat template: its segments, and each document's ids in cached order."""

    facts: FactPrompt
    segmented: object  # SegmentedPrompt in the request's document order
    cached_docs: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, harness: PICHarness, facts: FactPrompt) -> ChatPrompt:
        segmented = harness.engine.tokenizer.segment_chat(facts.messages())
        pic = [segmented.segment_ids(s) for s in segmented.pic_segments]
        by_index = dict(zip(facts.order, pic))
        return cls(facts, segmented, tuple(by_index[i] for i in range(len(facts.organisations))))


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


@torch.inference_mode()
def reply_tokens(harness: PICHarness, logits: torch.Tensor, reference: list[int], table: torch.Tensor,
                 num_prompt: int) -> list[int]:
    """The backend's own greedy reply: the PIC-off reply up to the first step the teacher-forced argmax leaves
    it (its K/V is already in ``table``), then decoded one token at a time."""
    choices = logits.argmax(-1).tolist()
    diverge = next((i for i, (a, b) in enumerate(zip(choices, reference)) if a != b), None)
    if diverge is None:
        return list(reference)
    tokens = reference[:diverge] + [choices[diverge]]
    while len(tokens) < len(reference):
        hidden, _ = harness.forward(tokens[-1:], table, num_prompt + len(tokens) - 1)
        tokens.append(int(harness.model.compute_logits(hidden).argmax()))
    return tokens


@torch.inference_mode()
def measure(harness: PICHarness, spec: str, prompt: ChatPrompt, reference, prefill_seconds: float) -> dict:
    backend = harness.backend(spec)
    segmented = prompt.segmented
    context = harness.executor.segment_context(backend, segmented.token_ids, segmented.pic_segments)
    for doc in prompt.cached_docs:  # the store warmed in index order, each document alone or behind the prefix
        harness.executor.cache.pic.unlock(harness.executor.lookup_or_prefill(backend, doc, context))
    num_tokens = len(prompt.segmented.token_ids)
    table = harness.allocate(num_tokens + REPLY_TOKENS)
    try:
        run, place_seconds = timed(lambda: harness.combine_run(backend, prompt.segmented, table))  # store hits
        result, seconds = timed(lambda: backend.combine(run))
        logits = teacher_forced_logits(harness, result.hidden, reference, num_tokens, table, None)
        kl = kl_per_row(reference.logits, logits)
        agree = (logits.argmax(-1) == torch.tensor(reference.continuation)).double()
        reply = reply_tokens(harness, logits, reference.continuation, table, num_tokens)
        text = harness.engine.tokenizer.decode(reply)
        return {"recomputed": result.num_recomputed / max(run.layout.num_reused, 1),
                "reused_share": run.layout.num_reused / num_tokens,
                "kl_next": float(kl[0]), "top1_next": float(agree[0]), "kl_tf": float(kl.mean()),
                "top1_tf": float(agree.mean()), "match20": float(reply == list(reference.continuation)),
                "correct": float(prompt.facts.is_correct(text)),
                "combine_share": (seconds + place_seconds) / prefill_seconds, "reply": text}
    finally:
        harness.release(table)


def reference_prompts(harness: PICHarness, num_prompts: int, seed: int, detail_sentences: int = 0):
    """Per seed ``seed`` .. ``seed + num_prompts - 1``: (prompt, its PIC-off ``Reference``, the PIC-off row:
    correct, reply, answer, num_tokens). The reference's pages are released when the caller asks for the next."""
    for index in range(num_prompts):
        prompt = ChatPrompt.build(harness, FactPrompt.random(seed + index, detail_sentences=detail_sentences))
        ids = list(prompt.segmented.token_ids)
        reference = full_reference(harness, ids, REPLY_TOKENS)
        try:
            text = harness.engine.tokenizer.decode(reference.continuation)
            yield prompt, reference, {"correct": float(prompt.facts.is_correct(text)), "reply": text,
                                      "answer": prompt.facts.answer, "num_tokens": len(ids)}
        finally:
            harness.release(reference.block_table)


def evaluate(harness: PICHarness, specs: list[str], num_prompts: int, seed: int,
             progress_path: str | None = None, detail_sentences: int = 0) -> dict:
    """Per prompt (``reference_prompts``) and spec, the rows of ``measure``; after each prompt the rows so far go to
    ``progress_path`` (JSON) when given, so a cut run still has them."""
    per_spec: dict[str, list[dict]] = {spec: [] for spec in specs}
    off = []
    for index, (prompt, reference, pic_off) in enumerate(reference_prompts(harness, num_prompts, seed,
                                                                             detail_sentences)):
        off.append(pic_off)
        for spec in specs:
            per_spec[spec].append(measure(harness, spec, prompt, reference, reference.prefill_seconds))
        print(f"prompt {index + 1}/{num_prompts}: PIC off {'right' if pic_off['correct'] else 'wrong'} "
              f"({pic_off['reply']!r}, answer {pic_off['answer']!r}), "
              + ", ".join(f"{spec} KL {per_spec[spec][-1]['kl_next']:.3f}" for spec in specs),
              file=sys.stderr, flush=True)
        if progress_path:
            Path(progress_path).write_text(json.dumps({"model": harness.engine.config.model, "pic_off": off,
                                                       "command": invoked_command(),
                                                       "segment_sink": harness.executor.bos_token_id,
                                                       "rows": per_spec}))
    return {"pic_off": off, "rows": per_spec,
            "results": [aggregate(spec, rows) for spec, rows in per_spec.items()]}


def aggregate(spec: str, rows: list[dict]) -> dict:
    keys = ("recomputed", "reused_share", "kl_next", "top1_next", "kl_tf", "top1_tf", "match20", "correct",
            "combine_share")
    return {"backend": spec, **{k: sum(r[k] for r in rows) / len(rows) for k in keys},
            "replies": [r["reply"] for r in rows]}


# ---------------------------------------------------------------- report


COLUMNS_EXPLAINED = ("KL in nats against PIC off; tf: over the PIC-off reply's 20 tokens, teacher-forced; accuracy: "
                     "the known fact appears in the 20-token greedy reply; times measured on a shared CPU (noisy).")


def describe(report: dict) -> str:
    off = report["pic_off"]
    sink = report["segment_sink"]
    return (f"{report['model']} (documents prefilled {'alone' if sink is None else f'behind sink token {sink}'}): "
            f"{report['num_prompts']} prompts of {report['mean_tokens']:.0f} tokens on average, "
            f"{report['reused_share']:.0%} of them in reused documents; PIC off answers "
            f"{report['pic_off_accuracy']:.0%} correctly ({sum(o['correct'] for o in off):.0f}/{len(off)}).")


def results_table(report: dict) -> Table:
    return Table(("backend", "recomputed", "KL next", "top-1 next", "KL tf", "top-1 tf", "20-token match", "accuracy",
                  "combine / prefill time"),
                 tuple((r["backend"], f"{r['recomputed']:.0%}", f"{r['kl_next']:.3f}", f"{r['top1_next']:.2f}",
                        f"{r['kl_tf']:.3f}", f"{r['top1_tf']:.2f}", f"{r['match20']:.2f}", f"{r['correct']:.2f}",
                        f"{r['combine_share']:.2f}") for r in report["results"]))


def format_markdown(report: dict) -> str:
    return "\n".join([describe(report), "", results_table(report).markdown(), "", COLUMNS_EXPLAINED])


PAGE_ABOUT = ("Each prompt is a chat (the model's own template) with 4-6 documents about invented organisations in "
              "`<pic>` tags, cached alone in one order and asked in another, and a question about one fact, so "
              "every reused document sits at a new position. Each PIC backend setting is compared with PIC off (a "
              "plain prefill of the same token ids): the KL and top-1 agreement of the next token and of the PIC-off "
              "reply's tokens, the 20-token greedy reply, and whether it states the known fact.")


PAGE_TITLE = "PIC quality on a real model"


def quality_page(report: dict, name: str, png: Path | None, title: str = PAGE_TITLE,
                 about: str = PAGE_ABOUT, notes: tuple[str, ...] = ()) -> ResultsPage:
    """The results page; a merged report names the commands that measured its parts (``measured_by``)."""
    measured = "".join(f"\n\nMeasured by `{command}`." for command in report.get("measured_by", ()))
    return ResultsPage(name, title, f"{about}\n\n{describe(report)}{measured}", (results_table(report),),
                       notes=(COLUMNS_EXPLAINED, *notes), png=png)


def sweep_line(spec: str) -> str:
    """The plot line of a spec: the spec without its swept option (``k`` / ``ratio``)."""
    name, _, options = spec.partition(":")
    kept = [o for o in options.split(",") if o and o.split("=")[0] not in ("k", "ratio")]
    return f"{name}:{','.join(kept)}" if kept else name


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[dict]] = {}
    for r in report["results"]:
        lines.setdefault(sweep_line(r["backend"]), []).append(r)
    figure, (kl_axis, top1_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in lines.items():
        rows = sorted(rows, key=lambda r: r["recomputed"])
        x = [r["recomputed"] for r in rows]
        kl_axis.plot(x, [max(r["kl_next"], 1e-6) for r in rows], marker="o", label=name)
        top1_axis.plot(x, [r["top1_tf"] for r in rows], marker="o", label=name)
    kl_axis.set(xlabel="reused tokens recomputed", ylabel="next-token KL vs PIC off (nats)", yscale="log")
    top1_axis.set(xlabel="reused tokens recomputed", ylabel="top-1 agreement over the reply (teacher-forced)",
                  ylim=(0, 1.02))
    top1_axis.legend()
    figure.suptitle(f"{report['model']}: {report['num_prompts']} fictional-fact RAG prompts")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(model: str, specs: list[str] | None, num_prompts: int, seed: int, page_size: int,
        markdown: str | None, png: str | None, sink: bool = True, sweep: bool = False,
        progress_path: str | None = None, detail_sentences: int = 0, docs_page: str | None = None,
        notes: tuple[str, ...] = ()) -> dict:
    harness = PICHarness(model, num_pages=400 if not detail_sentences else 1600, page_size=page_size)
    if not sink:
        harness.executor.bos_token_id = None  # documents prefilled alone, with no sink before them
    if harness.has_linear_attention:
        raise SystemExit("--prompts facts measures attention-only models (HYPIC has its own tests)")
    specs = specs or list(DEFAULT_SPECS)
    if sweep:
        specs = with_sweep(specs)
    measured = evaluate(harness, specs, num_prompts, seed, progress_path, detail_sentences)
    return finish({"model": model, "segment_sink": harness.executor.bos_token_id, "seed": seed,
                   "detail_sentences": detail_sentences, "command": invoked_command(), **measured},
                  markdown, png, docs_page, notes=notes)


def finish(report: dict, markdown: str | None, png: str | None, docs_page: str | None = None,
           page_title: str = PAGE_TITLE, page_about: str = PAGE_ABOUT, notes: tuple[str, ...] = ()) -> dict:
    """Add the summary fields to a report of ``pic_off`` and per-spec ``rows``, print it, write table and plot, and
    the results page ``docs/results/<docs_page>.md`` when named (with the plot beside it)."""
    off = report["pic_off"]
    results = [aggregate(spec, rows) for spec, rows in report["rows"].items()]
    report = {**report, "num_prompts": len(off), "mean_tokens": sum(o["num_tokens"] for o in off) / len(off),
              "reused_share": results[0]["reused_share"] if results else 0.0,
              "pic_off_accuracy": sum(o["correct"] for o in off) / len(off), "results": results}
    text = format_markdown(report)
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text + "\n")
    if png:
        plot(report, png)
        print(f"wrote {png}")
    if docs_page:
        page_png = Path(png) if png else DOCS_RESULTS / f"{docs_page}.png"
        if not png:
            page_png.parent.mkdir(parents=True, exist_ok=True)
            plot(report, str(page_png))
        print(f"wrote {write_page(quality_page(report, docs_page, page_png, page_title, page_about, notes))}")
    return report


def merge(paths: list[str], markdown: str | None, png: str | None, model: str | None = None,
          docs_page: str | None = None, notes: tuple[str, ...] = ()) -> dict:
    """One report from runs (``--out`` JSONs, or progress files) over disjoint prompts with the same specs, or over
    the same prompts with disjoint specs (one run's rows beside another's); the commands that measured them
    (recorded in the JSONs) go on the page."""
    parts = [json.loads(Path(path).read_text()) for path in paths]
    specs = [list(part["rows"]) for part in parts]
    prompts = [[(off["answer"], off["num_tokens"]) for off in part["pic_off"]] for part in parts]
    every_spec = [spec for part_specs in specs for spec in part_specs]
    if all(s == specs[0] for s in specs):
        rows = {spec: [row for part in parts for row in part["rows"][spec]] for spec in specs[0]}
        pic_off = [o for part in parts for o in part["pic_off"]]
    elif all(p == prompts[0] for p in prompts) and len(set(every_spec)) == len(every_spec):
        rows = {spec: part["rows"][spec] for part in parts for spec in part["rows"]}
        pic_off = parts[0]["pic_off"]
    else:
        raise SystemExit(f"--merge needs runs of the same backend specs over disjoint prompts, or of disjoint specs "
                         f"over the same prompts; got specs {specs} over {[len(p) for p in prompts]} prompts")
    first = parts[0]
    return finish({"model": first.get("model", model or "?"), "segment_sink": first.get("segment_sink"),
                   "pic_off": pic_off, "rows": rows,
                   "measured_by": [part["command"] for part in parts if part.get("command")]},
                  markdown, png, docs_page, notes=notes)

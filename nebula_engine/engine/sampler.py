"""Token sampling, vLLM's order: grammar mask, allowed token ids, min_tokens, bad words, logit bias, penalties,
then greedy or temperature, min-p, top-k, top-p; per-request seeds.

Every transform runs on the whole batch at once (``logits_processors``); the per-row Python work is building a
row's settings, never a pass over the vocabulary. Penalties read per-sequence token counts kept here as tensors
and brought up to date from the sequence's tokens each step (one indexed add for the tokens new since the last
step), so they also hold after a preemption or for a request prefilled by another engine.

A seeded request draws its noise from its own ``torch.Generator`` over its own row only, so its tokens do not
depend on what else is in the batch. Logprobs (the sampled token's, and the top k when asked) are taken from the
unmodified logits (vLLM's default ``raw_logprobs``), whatever the sampling settings.

Each row's own state (its generator, token counts, grammar matcher) is built for that row alone: a request whose
state cannot be built is reported in ``SamplerOutput.failed`` and left out, and the batch goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Sequence

import torch

from nebula_engine.engine.logits_processors import (apply_min_p, apply_penalties, apply_top_k_top_p,
                                                    sparse_rows)
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.structured_outputs import GrammarCompiler

__all__ = ["RowHistory", "Sampler", "SamplerOutput", "TopLogprobs", "apply_top_k_top_p"]


@dataclass(frozen=True)
class RowHistory:
    """The tokens of the sequence a row samples for: prompt then output (the sequence's own list, read only)."""

    token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class TopLogprobs:
    """The sampled token, then the top k of a row, with their logprobs and ranks (1 = most likely)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # one per row that did not fail, in row order
    logprobs: list[float]  # the sampled token's, under the unmodified logits
    failed: dict[str, Exception] = field(default_factory=dict)  # seq id -> why its row could not be sampled
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)  # per row; None unless params.logprobs


@dataclass
class _TokenCounts:
    prompt_mask: torch.Tensor  # [V] bool
    output_counts: torch.Tensor  # [V] float
    num_counted: int = 0  # output tokens already in output_counts


@dataclass
class _GrammarState:
    matcher: object  # xgrammar.GrammarMatcher
    num_accepted: int = 0  # output tokens the matcher has consumed


@dataclass(frozen=True)
class _Row:
    params: SamplingParams
    history: RowHistory
    top_k: int  # 0: no limit
    generator: torch.Generator | None  # None for greedy rows
    counts: _TokenCounts | None  # rows with penalties only
    grammar: _GrammarState | None  # rows with structured outputs only


def first_max_index(values: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first maximum, as ``argmax``: torch's ``max`` over a dim returns the same index and on
    CPU took a third to a half of argmax's time (1 x 49,152 logits: 29 against 63 us; 1 x 151,936: 64 against 192
    us; 2 threads)."""
    return values.max(dim=-1).indices


class Sampler:
    """Samples one token per row; owns each request's generator, token counts and grammar matcher until
    ``release``."""

    def __init__(self, seed: int, device: torch.device | str = "cpu", eos_token_ids: Collection[int] = (),
                 grammar_compiler: GrammarCompiler | None = None):
        self.device = torch.device(device)
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.grammar_compiler = grammar_compiler
        self._default_generator = torch.Generator(self.device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._counts: dict[str, _TokenCounts] = {}
        self._grammars: dict[str, _GrammarState] = {}

    def release(self, seq_id: str) -> None:
        self._generators.pop(seq_id, None)
        self._counts.pop(seq_id, None)
        self._grammars.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, seq_ids: list[str], params: list[SamplingParams],
                 histories: list[RowHistory] | None = None) -> SamplerOutput:
        """logits [n, V] fp32, one row per sequence that samples this step; ``histories`` (default: empty) are
        the rows' tokens, which penalties, min_tokens and structured outputs read."""
        histories = histories if histories is not None else [RowHistory()] * len(seq_ids)
        rows, failed = [], {}
        for seq_id, p, history in zip(seq_ids, params, histories):
            try:
                rows.append(self._row(seq_id, p, history, logits.shape[-1]))
            except Exception as exc:  # this request's own state: only this request fails
                failed[seq_id] = exc
        if failed:
            keep = [i for i, seq_id in enumerate(seq_ids) if seq_id not in failed]
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
        if not rows:
            return SamplerOutput([], [], failed, [])
        raw = logits
        logits = self._process(logits, rows)
        tokens = first_max_index(logits)
        random_rows = [i for i, r in enumerate(rows) if r.generator is not None]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            tokens[index] = self._sample(logits[index], [rows[i] for i in random_rows])
        # the sampled token's logprob from a whole log-softmax: one fused kernel, 0.38-0.47 ms at 32 x 49,152 where
        # gather minus logsumexp (five passes) took 0.90-1.37 ms (2 threads, this repo's CPU machine)
        logprobs = torch.log_softmax(raw, dim=-1)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        if any(r.params.logprobs is not None for r in rows):
            top = self._top_logprobs(logprobs, tokens, chosen, rows)
        else:
            top = [None] * len(rows)
        return SamplerOutput(tokens.tolist(), chosen.tolist(), failed, top)

    # ---- per-row state ----

    def _row(self, seq_id: str, params: SamplingParams, history: RowHistory, vocab_size: int) -> _Row:
        counts = self._token_counts(seq_id, history, vocab_size) if params.has_penalties else None
        grammar = self._grammar(seq_id, params, history) if params.structured_outputs is not None else None
        if params.is_greedy:
            return _Row(params, history, 0, None, counts, grammar)
        top_k = params.top_k if 0 < params.top_k < vocab_size else 0  # at or above the vocabulary: every token
        return _Row(params, history, top_k, self._generator(seq_id, params), counts, grammar)

    def _generator(self, seq_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default_generator
        if seq_id not in self._generators:
            self._generators[seq_id] = torch.Generator(self.device).manual_seed(params.seed)
        return self._generators[seq_id]

    def _token_counts(self, seq_id: str, history: RowHistory, vocab_size: int) -> _TokenCounts:
        counts = self._counts.get(seq_id)
        if counts is None:
            prompt = torch.tensor(history.token_ids[:history.num_prompt_tokens], dtype=torch.long, device=self.device)
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            mask[prompt] = True
            counts = self._counts[seq_id] = _TokenCounts(mask, torch.zeros(vocab_size, device=self.device))
        new = history.token_ids[history.num_prompt_tokens + counts.num_counted:]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=self.device)
            counts.output_counts.index_add_(0, ids, torch.ones(len(new), device=self.device))
            counts.num_counted += len(new)
        return counts

    def _grammar(self, seq_id: str, params: SamplingParams, history: RowHistory) -> _GrammarState:
        state = self._grammars.get(seq_id)
        if state is None:
            if self.grammar_compiler is None:
                raise ValueError("this sampler has no grammar compiler: it cannot serve structured outputs")
            state = self._grammars[seq_id] = _GrammarState(self.grammar_compiler.matcher(params.structured_outputs))
        for token in history.token_ids[history.num_prompt_tokens + state.num_accepted:]:
            if not state.matcher.accept_token(token):
                raise ValueError(f"token {token} does not follow the request's structured output grammar")
            state.num_accepted += 1
        return state

    # ---- batched transforms ----

    def _process(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Grammar mask, min_tokens, logit bias, penalties: the transforms greedy rows get too."""
        if any(r.grammar is not None for r in rows):
            logits = self._apply_grammar(logits, rows)
        if any(r.params.allowed_token_ids is not None for r in rows):
            logits = self._apply_allowed(logits, rows)
        masked = [(i, t, float("-inf")) for i, r in enumerate(rows)
                  if r.history.num_output_tokens < r.params.min_tokens for t in self._stop_ids(r.params)]
        masked += [(i, t, float("-inf")) for i, r in enumerate(rows) if r.params.bad_words_token_ids
                   for t in banned_tokens(r.params.bad_words_token_ids, r.history) if t < logits.shape[-1]]
        biased = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items()]
        if masked or biased:
            logits = logits.clone()
            if biased:
                index_rows, cols, values = sparse_rows(biased, logits.device)
                logits.index_put_((index_rows, cols), values.to(logits.dtype), accumulate=True)
            if masked:
                index_rows, cols, values = sparse_rows(masked, logits.device)
                logits[index_rows, cols] = values.to(logits.dtype)
        penalized = [i for i, r in enumerate(rows) if r.counts is not None]
        if penalized:
            index = torch.tensor(penalized, device=logits.device)
            chosen = [rows[i] for i in penalized]
            logits = logits.index_copy(0, index, apply_penalties(
                logits[index],
                torch.stack([r.counts.prompt_mask for r in chosen]),
                torch.stack([r.counts.output_counts for r in chosen]),
                self._per_row(chosen, "repetition_penalty", logits),
                self._per_row(chosen, "frequency_penalty", logits),
                self._per_row(chosen, "presence_penalty", logits)))
        return logits

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        return params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)

    @staticmethod
    def _apply_allowed(logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Rows with ``allowed_token_ids`` keep those logits only (ids past the vocabulary allow nothing more)."""
        vocab = logits.shape[-1]
        allowed = [(i, t, 0.0) for i, r in enumerate(rows) if r.params.allowed_token_ids is not None
                   for t in r.params.allowed_token_ids if t < vocab]
        restricted = torch.tensor([r.params.allowed_token_ids is not None for r in rows], device=logits.device)
        mask = torch.zeros_like(logits, dtype=torch.bool)
        if allowed:
            index_rows, cols, _ = sparse_rows(allowed, logits.device)
            mask[index_rows, cols] = True
        return logits.masked_fill(restricted[:, None] & ~mask, float("-inf"))

    @staticmethod
    def _apply_grammar(logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        import xgrammar

        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        bitmask = xgrammar.allocate_token_bitmask(len(rows), logits.shape[-1])
        for i in constrained:
            rows[i].grammar.matcher.fill_next_token_bitmask(bitmask, i)
        logits = logits.clone()
        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=constrained)
        return logits

    @staticmethod
    def _per_row(rows: list[_Row], name: str, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor([float(getattr(r.params, name)) for r in rows], dtype=like.dtype, device=like.device)

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        logits = logits / self._per_row(rows, "temperature", logits)[:, None]
        if any(r.params.min_p > 0 for r in rows):
            logits = apply_min_p(logits, self._per_row(rows, "min_p", logits))
        if any(r.top_k > 0 or r.params.top_p < 1 for r in rows):
            top_k = torch.tensor([r.top_k for r in rows], device=logits.device)
            logits = apply_top_k_top_p(logits, top_k, self._per_row(rows, "top_p", logits))
        probs = logits.softmax(dim=-1)
        # exponential race: argmax(p / E) with E ~ Exp(1) samples from p; noise drawn per row
        noise = torch.empty_like(probs)
        for row, r in enumerate(rows):
            noise[row].exponential_(generator=r.generator)
        return first_max_index(probs / noise)

    @staticmethod
    def _top_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, chosen: torch.Tensor,
                      rows: list[_Row]) -> list[TopLogprobs | None]:
        asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        result: list[TopLogprobs | None] = [None] * len(rows)
        if asking:
            index = torch.tensor(asking, device=logprobs.device)
            found = top_logprobs(logprobs[index], tokens[index], [rows[i].params.logprobs for i in asking])
            for i, entry in zip(asking, found):
                result[i] = entry
        return result


def banned_tokens(bad_words_token_ids: Sequence[Sequence[int]], history: RowHistory) -> list[int]:
    """The tokens that would complete a bad word now (vLLM's rule): a one-token word always; a longer one when the
    output so far ends with all but its last token."""
    output = history.token_ids[history.num_prompt_tokens:]
    banned = []
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or list(output[len(output) - len(prefix):]) == list(prefix)):
            banned.append(word[-1])
    return banned


def top_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TopLogprobs]:
    """For each row of ``logprobs`` [m, V]: its token ``tokens`` [m] then its top ``ks[row]`` (at most the whole
    vocabulary), with their logprobs and ranks (vLLM's rank: the number of tokens at least as likely)."""
    chosen = logprobs.gather(1, tokens[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    ks = [min(k, logprobs.shape[-1]) for k in ks]
    k_max = max(ks)
    top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (logprobs[:, :0], logprobs[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    token_list, chosen_list = tokens.tolist(), chosen.squeeze(1).tolist()
    return [TopLogprobs((token_list[j], *top_ids[j][:k]), (chosen_list[j], *top_values[j][:k]),
                        (ranks[j], *range(1, k + 1)))
            for j, k in enumerate(ks)]

"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws its noise from its own ``torch.Generator`` over its own row only, so its
tokens do not depend on what else is in the batch. The returned logprob is that of the sampled
token under the unmodified logits (vLLM's default), whatever the sampling settings.

Each row's own state (its generator, its settings as plain numbers) is built for that row alone: a request
whose state cannot be built is reported in ``SamplerOutput.failed`` and left out, and the batch goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nebula_engine.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # one per row that did not fail, in row order
    logprobs: list[float]
    failed: dict[str, Exception] = field(default_factory=dict)  # seq id -> why its row could not be sampled


@dataclass(frozen=True)
class _RowSettings:
    temperature: float
    top_k: int  # 0: no limit
    top_p: float
    generator: torch.Generator | None  # None for greedy rows


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    logits [n, V]; top_k [n] int (<= 0 means no limit); top_p [n] float in (0, 1]. Top-p is taken
    over the distribution renormalised after top-k; the most likely token always survives.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    k = torch.where(top_k > 0, top_k, logits.shape[-1])
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill((mass_before >= top_p[:, None]) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


class Sampler:
    """Samples one token per row; owns the per-request generators until ``release``."""

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._default_generator = torch.Generator(self.device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, seq_id: str) -> None:
        self._generators.pop(seq_id, None)

    def _generator(self, seq_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default_generator
        if seq_id not in self._generators:
            self._generators[seq_id] = torch.Generator(self.device).manual_seed(params.seed)
        return self._generators[seq_id]

    def __call__(self, logits: torch.Tensor, seq_ids: list[str], params: list[SamplingParams]) -> SamplerOutput:
        """logits [n, V] fp32, one row per sequence that samples this step."""
        settings, failed = [], {}
        for seq_id, p in zip(seq_ids, params):
            try:
                settings.append(self._row_settings(seq_id, p, logits.shape[-1]))
            except Exception as exc:  # this request's own state: only this request fails
                failed[seq_id] = exc
        if failed:
            keep = [i for i, seq_id in enumerate(seq_ids) if seq_id not in failed]
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(settings) if s.generator is not None]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            tokens[rows] = self._sample(logits[rows], [settings[i] for i in random_rows])
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        return SamplerOutput(tokens.tolist(), chosen.tolist(), failed)

    def _row_settings(self, seq_id: str, params: SamplingParams, vocab_size: int) -> _RowSettings:
        if params.is_greedy:
            return _RowSettings(0.0, 0, 1.0, None)
        top_k = params.top_k if 0 < params.top_k < vocab_size else 0  # at or above the vocabulary: every token
        return _RowSettings(float(params.temperature), top_k, float(params.top_p), self._generator(seq_id, params))

    def _sample(self, logits: torch.Tensor, settings: list[_RowSettings]) -> torch.Tensor:
        temperature = torch.tensor([s.temperature for s in settings], device=logits.device)
        logits = logits / temperature[:, None]
        if any(s.top_k > 0 or s.top_p < 1 for s in settings):
            top_k = torch.tensor([s.top_k for s in settings], device=logits.device)
            top_p = torch.tensor([s.top_p for s in settings], device=logits.device, dtype=logits.dtype)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        # exponential race: argmax(p / E) with E ~ Exp(1) samples from p; noise drawn per row
        noise = torch.empty_like(probs)
        for row, s in enumerate(settings):
            noise[row].exponential_(generator=s.generator)
        return (probs / noise).argmax(dim=-1)

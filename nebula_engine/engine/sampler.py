"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws its noise from its own ``torch.Generator`` over its own row only, so its
tokens do not depend on what else is in the batch. The returned logprob is that of the sampled
token under the unmodified logits (vLLM's default), whatever the sampling settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nebula_engine.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]


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
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            picked = self._sample(logits[rows], [seq_ids[i] for i in random_rows], [params[i] for i in random_rows])
            tokens[rows] = picked
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        return SamplerOutput(tokens.tolist(), chosen.tolist())

    def _sample(self, logits: torch.Tensor, seq_ids: list[str], params: list[SamplingParams]) -> torch.Tensor:
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=logits.device)
            top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        # exponential race: argmax(p / E) with E ~ Exp(1) samples from p; noise drawn per row
        noise = torch.empty_like(probs)
        for row, (seq_id, p) in enumerate(zip(seq_ids, params)):
            noise[row].exponential_(generator=self._generator(seq_id, p))
        return (probs / noise).argmax(dim=-1)

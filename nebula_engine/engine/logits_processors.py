"""Batched logits transforms of vLLM's sampler: penalties, logit bias, min_tokens, min_p, top-k / top-p.

Each works on a whole batch [n, V] at once from per-row parameter tensors; none loops over the vocabulary.
"""

from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """logits [n, V]; prompt_mask [n, V] bool (token occurs in the prompt); output_counts [n, V] (occurrences among
    the generated tokens); repetition / frequency / presence [n].

    Repetition penalty (HF / CTRL, as vLLM): a token seen in the prompt or the output has its logit divided by
    the penalty when positive, multiplied when negative. Frequency and presence penalties (OpenAI): subtract
    ``frequency * count + presence * (count > 0)`` over the generated tokens only."""
    seen = prompt_mask | (output_counts > 0)
    penalty = repetition[:, None]
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the tokens whose probability is below ``min_p`` times the row's largest (min_p [n] in [0, 1])."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


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


def sparse_rows(entries: list[tuple[int, int, float]], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, token id, value) triples as three tensors, for one indexed update of a [n, V] batch."""
    rows, cols, values = zip(*entries)
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(cols, dtype=torch.long, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))

"""Penalties, logit bias, min_tokens, min_p and top logprobs in the sampler, each against a torch reference
written per row and against the same batch without the option."""

import pytest
import torch

from nebula_engine.engine.logits_processors import apply_min_p, apply_penalties
from nebula_engine.engine.sampler import RowHistory, Sampler
from nebula_engine.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")
V = 12


def random_logits(rows, vocab=V, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def reference_penalties(logits, prompt, output, rep, freq, pres):
    """One row, written as HF's RepetitionPenaltyLogitsProcessor and OpenAI's penalty formula describe it."""
    out = logits.clone()
    for token in set(prompt) | set(output):
        out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
    for token in set(output):
        out[token] -= freq * output.count(token) + pres
    return out


def test_penalties_match_the_per_row_reference():
    logits = random_logits(3)
    histories = [([1, 2, 3], [3, 3, 5]), ([0], []), ([4, 4], [7, 8, 7, 7])]
    settings = [(1.3, 0.5, 0.2), (0.7, -0.4, 1.0), (1.0, 2.0, -2.0)]
    prompt_mask = torch.zeros(3, V, dtype=torch.bool)
    counts = torch.zeros(3, V)
    for row, (prompt, output) in enumerate(histories):
        prompt_mask[row, prompt] = True
        for t in output:
            counts[row, t] += 1
    rep, freq, pres = (torch.tensor(column) for column in zip(*settings))
    got = apply_penalties(logits, prompt_mask, counts, rep, freq, pres)
    for row, ((prompt, output), (r, f, p)) in enumerate(zip(histories, settings)):
        torch.testing.assert_close(got[row], reference_penalties(logits[row], prompt, output, r, f, p))


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs.log(), torch.tensor([0.25, 0.0]))
    assert (out > NEG_INF).tolist() == [[True, True, True, False], [True] * 4]  # 0.05 < 0.25 * 0.5 <= 0.15


def history(prompt, output):
    return RowHistory(list(prompt) + list(output), len(prompt))


def test_sampler_penalties_follow_the_tokens_of_each_step():
    """Counts are caught up from the sequence's tokens every step, so they match a fresh computation."""
    logits = random_logits(1)
    params = SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2)
    sampler = Sampler(seed=0)
    prompt, output = [1, 2], []
    for _ in range(6):
        token = sampler(logits, ["a"], [params], [history(prompt, output)]).token_ids[0]
        expected = reference_penalties(logits[0], prompt, output, 1.2, 1.5, 0.5).argmax().item()
        assert token == expected
        output.append(token)
    assert len(set(output)) > 1  # the penalties moved greedy off its first choice


def test_logit_bias_forces_and_forbids_tokens_greedy_and_sampled():
    logits = random_logits(2)
    loser = logits[0].argmin().item()
    winner = logits[1].argmax().item()
    params = [SamplingParams(temperature=0.0, logit_bias={loser: 100.0}),
              SamplingParams(temperature=1.0, seed=1, logit_bias={winner: -100.0})]
    sampler = Sampler(seed=0)
    for _ in range(20):
        out = sampler(logits, ["a", "b"], params)
        assert out.token_ids[0] == loser and out.token_ids[1] != winner
    unbiased = Sampler(seed=0)(logits[:1], ["a"], [SamplingParams(temperature=0.0)])
    assert unbiased.token_ids == [logits[0].argmax().item()]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = random_logits(1)
    eos, stop = logits[0].topk(2).indices.tolist()
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], max_tokens=10)
    sampler = Sampler(seed=0, eos_token_ids=[eos])
    tokens = [sampler(logits, ["a"], [params], [history([0], [9] * n)]).token_ids[0] for n in range(5)]
    third = logits[0].topk(3).indices[2].item()
    assert tokens == [third, third, third, eos, eos]
    ignore = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, max_tokens=10)
    assert sampler(logits, ["b"], [ignore], [history([0], [])]).token_ids == [eos]  # EOS does not stop: not masked


def test_min_p_one_keeps_only_the_most_likely_token():
    logits = random_logits(1)
    sampler = Sampler(seed=0)
    tokens = {sampler(logits, ["a"], [SamplingParams(temperature=2.0, min_p=1.0, seed=s)]).token_ids[0]
              for s in range(20)}
    assert tokens == {logits[0].argmax().item()}


@pytest.mark.parametrize("k", [0, 1, 5])
def test_top_logprobs_are_the_log_softmax_of_the_unmodified_logits(k):
    logits = random_logits(3)
    params = [SamplingParams(temperature=1.0, seed=3, logprobs=k, repetition_penalty=2.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=k, logit_bias={0: 50.0})]
    out = Sampler(seed=0)(logits, ["a", "b", "c"], params, [history([1], [2])] * 3)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.top_logprobs[1] is None
    for row in (0, 2):
        top = out.top_logprobs[row]
        sampled = out.token_ids[row]
        assert top.token_ids[0] == sampled
        assert top.ranks[0] == int((reference[row] >= reference[row, sampled]).sum())
        expected_top = reference[row].topk(k) if k else None
        assert list(top.token_ids[1:]) == (expected_top.indices.tolist() if k else [])
        assert list(top.ranks[1:]) == list(range(1, k + 1))
        torch.testing.assert_close(torch.tensor(top.logprobs), reference[row, list(top.token_ids)])
    assert out.token_ids[2] == 0  # the bias chose the token; its logprob is still the unbiased one

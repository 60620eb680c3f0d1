import math

import pytest
import torch

from nebula_engine.engine.sampler import Sampler, apply_top_k_top_p, first_max_index
from nebula_engine.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.0, 1.0, 2.0, 3.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert out.tolist() == [[NEG_INF, 4.0, 3.0, NEG_INF], [0.0, 1.0, 2.0, 3.0]]


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    # probs 0.5, 0.25, 0.125, 0.125: p=0.7 needs the first two; p=0.75 exactly reaches with two
    logits = torch.log(torch.tensor([[0.125, 0.5, 0.125, 0.25]] * 3))
    out = apply_top_k_top_p(logits, torch.tensor([0, 0, 0]), torch.tensor([0.7, 0.75, 0.3]))
    kept = (out > NEG_INF).tolist()
    assert kept[0] == [False, True, False, True]
    assert kept[1] == [False, True, False, True]
    assert kept[2] == [False, True, False, False]  # the top token always survives


def test_top_p_applies_to_the_distribution_renormalised_after_top_k():
    # top-1 leaves one token; after top-3 the renormalised probs are 0.375, 0.3125, 0.3125, so
    # p=0.5 keeps the first two (ties broken by index)
    logits = torch.log(torch.tensor([[0.3, 0.2, 0.25, 0.25]]))
    out = apply_top_k_top_p(logits, torch.tensor([1]), torch.tensor([0.5]))
    assert (out > NEG_INF).tolist() == [[True, False, False, False]]
    out = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.5]))
    assert (out > NEG_INF).tolist() == [[True, False, True, False]]


def random_logits(rows, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw(sampler, logits, seq_ids, params, steps=20):
    return [sampler(logits, seq_ids, params).token_ids for _ in range(steps)]


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = random_logits(1)
    params = [SamplingParams(temperature=1.0, seed=7)]
    first = draw(Sampler(seed=0), logits, ["a"], params)
    again = draw(Sampler(seed=123), logits, ["a"], params)
    other = draw(Sampler(seed=0), logits, ["a"], [SamplingParams(temperature=1.0, seed=8)])
    assert first == again
    assert first != other


def test_seeded_request_does_not_depend_on_batch_composition():
    logits = random_logits(3)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=42)
    alone = draw(Sampler(seed=0), logits[1:2], ["x"], [seeded])
    batch_params = [SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.0)]
    in_batch = draw(Sampler(seed=5), logits, ["u", "x", "g"], batch_params)
    assert [row[0] for row in alone] == [row[1] for row in in_batch]


def test_greedy_rows_take_argmax_and_logprobs_use_unmodified_logits():
    logits = random_logits(2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=3, seed=1)]
    out = Sampler(seed=0)(logits, ["a", "b"], params)
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[1] in logits[1].topk(3).indices.tolist()
    expected = torch.log_softmax(logits, -1)[[0, 1], out.token_ids]
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)


def test_sampling_follows_the_distribution():
    probs = torch.tensor([[0.6, 0.3, 0.1]])
    sampler = Sampler(seed=0)
    params = [SamplingParams(temperature=1.0, seed=3)]
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sampler(probs.log(), ["a"], params).token_ids[0]] += 1
    freq = [c / 3000 for c in counts]
    assert freq == pytest.approx([0.6, 0.3, 0.1], abs=0.04)


def test_top_k_one_is_greedy_even_at_high_temperature():
    logits = random_logits(1)
    tokens = draw(Sampler(seed=0), logits, ["a"], [SamplingParams(temperature=5.0, top_k=1)])
    assert {row[0] for row in tokens} == {logits[0].argmax().item()}


def test_release_restarts_a_seeded_stream():
    logits = random_logits(1)
    sampler = Sampler(seed=0)
    params = [SamplingParams(temperature=1.0, seed=9)]
    first = draw(sampler, logits, ["a"], params, steps=5)
    sampler.release("a")
    assert draw(sampler, logits, ["a"], params, steps=5) == first
    assert not math.isnan(sampler(logits, ["a"], params).logprobs[0])


def test_first_max_index_is_argmax_with_ties_infinities_and_nans():
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 1.0, 5.0, nan], [-inf] * 4, [0.0] * 4, [2.0, inf, inf, 1.0]])
    assert torch.equal(first_max_index(rows), rows.argmax(dim=-1))
    generator = torch.Generator().manual_seed(0)
    ties = torch.randint(0, 4, (64, 1000), generator=generator).float()  # many equal maxima a row
    assert torch.equal(first_max_index(ties), ties.argmax(dim=-1))

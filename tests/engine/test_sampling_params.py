"""SamplingParams hold only what the engine can run: every bound is checked when the params are made."""

import math

import pytest
import torch

from nebula_engine.engine.sampler import Sampler
from nebula_engine.engine.sampling_params import (INT64_MAX, INT64_MIN, MAX_STOP_CHARS, MAX_STOP_SEQUENCES,
                                                  MAX_TOP_K, SamplingParams)

BAD = [
    dict(seed=2 ** 64), dict(seed=INT64_MAX + 1), dict(seed=INT64_MIN - 1), dict(seed=1.5), dict(seed=True),
    dict(top_k=2 ** 63), dict(top_k=MAX_TOP_K + 1), dict(top_k=-2), dict(top_k=2.0),
    dict(max_tokens=0), dict(max_tokens=2 ** 64), dict(max_tokens=True),
    dict(temperature=-0.1), dict(temperature=math.inf), dict(temperature=math.nan), dict(temperature="1"),
    dict(top_p=0), dict(top_p=1.01), dict(top_p=math.nan),
    dict(stop=["s"] * (MAX_STOP_SEQUENCES + 1)), dict(stop="x" * (MAX_STOP_CHARS + 1)), dict(stop=[""]),
    dict(stop=["ok", 3]), dict(stop="abc \ud800 def"),
    dict(stop_token_ids=[-1]), dict(stop_token_ids=[2 ** 31]), dict(stop_token_ids=["1"]),
    dict(ignore_eos="yes"),
]


@pytest.mark.parametrize("fields", BAD, ids=[str(i) for i in range(len(BAD))])
def test_values_the_engine_cannot_hold_are_value_errors(fields):
    name = next(iter(fields))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)


def test_the_bounds_themselves_are_accepted():
    SamplingParams(seed=INT64_MIN)
    SamplingParams(seed=INT64_MAX, top_k=MAX_TOP_K, temperature=5.0, top_p=1e-9, max_tokens=INT64_MAX)
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_SEQUENCES, stop_token_ids=[0, 2 ** 31 - 1])


def test_tiny_temperatures_sample_greedily_instead_of_overflowing():
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(0)) * 5
    params = SamplingParams(temperature=1e-300, seed=3)
    assert params.is_greedy
    assert Sampler(0)(logits, ["a"], [params]).token_ids == [logits.argmax().item()]


def test_top_k_at_or_above_the_vocabulary_keeps_every_token():
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(1))
    unlimited = [Sampler(0)(logits, ["a"], [SamplingParams(temperature=1.0, seed=s)]).token_ids for s in range(8)]
    huge_k = [Sampler(0)(logits, ["a"], [SamplingParams(temperature=1.0, seed=s, top_k=MAX_TOP_K)]).token_ids
              for s in range(8)]
    assert huge_k == unlimited


def test_text_that_is_not_valid_unicode_is_a_value_error_offline(llm):
    with pytest.raises(ValueError, match="lone surrogate U\\+D800 at index 4"):
        llm.generate("abc \ud800 def")
    with pytest.raises(ValueError, match="lone surrogate"):
        llm.chat([{"role": "user", "content": "abc \ud800 def"}])
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("fine", SamplingParams(stop_token_ids=[10 ** 9]))

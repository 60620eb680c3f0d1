"""A request whose own work fails inside an engine step fails alone; the others in the batch complete with exactly
the tokens they get without it. Failures come from real code paths: a sampler state that cannot be built, a
batched forward that raises for one request's input (found by re-running halves), a combine prefill that raises."""

from __future__ import annotations

import pytest

from nebula_engine import LLM, SamplingParams
from tests.model_cases import CASES_BY_NAME

PROMPTS = ["a b c d e f g h", "Once upon a time", "1, 2, 3,"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SETTINGS = dict(num_pages=256, page_size=8, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), **SETTINGS)


@pytest.fixture(scope="module")
def expected(llm):
    """Each prompt's tokens when nothing fails next to it."""
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def unbuildable_seed() -> SamplingParams:
    """What ``"seed": 18446744073709551616`` would be without the API's bounds: it reaches the sampler, whose
    ``torch.Generator.manual_seed`` overflows. Set past validation, as an older client of the engine could."""
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=1)
    object.__setattr__(params, "seed", 2 ** 64)
    return params


def assert_only_the_culprit_failed(llm, outputs, culprit: int, expected, message: str) -> None:
    failed = outputs[culprit]
    assert failed.finished and failed.outputs[0].finish_reason == "error" and message in failed.error
    others = [o for i, o in enumerate(outputs) if i != culprit]
    assert [o.outputs[0].token_ids for o in others] == expected
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in others)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert failed.request_id not in engine.scheduler.kv_cache.block_tables  # its pages went back to the pool


def test_a_request_whose_sampler_state_cannot_be_built_fails_alone(llm, expected):
    outputs = llm.generate(PROMPTS[:1] + ["poisoned"] + PROMPTS[1:], [GREEDY, unbuildable_seed(), GREEDY, GREEDY])
    assert_only_the_culprit_failed(llm, outputs, 1, expected, "Overflow")
    assert llm.generate(PROMPTS, GREEDY)[0].outputs[0].token_ids == expected[0]  # and the engine serves on


POISON = 4242  # a token id the forward refuses, standing for any input one request brings that breaks a batch


@pytest.fixture()
def poisoned_forward(monkeypatch):
    """Make ``llm``'s model raise on every forward whose batch holds ``POISON``; returns the forward count."""
    calls = []

    def install(llm: LLM) -> list:
        model = llm.llm_engine.model_runner.model
        name = "forward_with_states" if llm.llm_engine.model_runner.kv_storage.linear_states else "forward"
        real = getattr(model, name)

        def forward(input_ids, *args, **kwargs):
            calls.append(input_ids.numel())
            if (input_ids == POISON).any():
                raise RuntimeError(f"token {POISON} breaks this batch")
            return real(input_ids, *args, **kwargs)

        monkeypatch.setattr(model, name, forward)
        return calls

    return install


def test_a_batched_forward_failure_is_pinned_on_its_request_by_rerunning_halves(llm, expected, poisoned_forward):
    assert all(POISON not in tokens for tokens in expected)
    calls = poisoned_forward(llm)
    poisoned = {"prompt_token_ids": [11, 12, POISON, 13]}
    outputs = llm.generate([PROMPTS[0], PROMPTS[1], poisoned, PROMPTS[2]], GREEDY)
    assert_only_the_culprit_failed(llm, outputs, 2, expected, f"token {POISON} breaks this batch")
    assert len(calls) > GREEDY.max_tokens  # the failing step ran again on parts of the batch


def test_hybrid_model_states_survive_the_rerun_of_a_failed_batch(checkpoint_factory, poisoned_forward):
    """Linear-attention states are stored only after a forward succeeds, so re-running halves continues from the
    states the failed batch started with."""
    llm = LLM(str(checkpoint_factory(CASES_BY_NAME["qwen3_5_linear_full_linear"])), pic_backend=None, **SETTINGS)
    # prompts of different lengths, so a chunk boundary does not line them up
    prompts = [{"prompt_token_ids": list(range(20, 20 + n))} for n in (9, 3, 14)]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert all(POISON not in tokens for tokens in reference)
    poisoned_forward(llm)
    outputs = llm.generate(prompts[:1] + [{"prompt_token_ids": [POISON, 5, 6]}] + prompts[1:], GREEDY)
    assert_only_the_culprit_failed(llm, outputs, 1, reference, "breaks this batch")


def test_a_failing_combine_prefill_fails_only_its_request(llm, expected, monkeypatch, caplog):
    """The step's PIC requests share one combine forward; when it raises for one request's input, each is
    combined again alone and only that one fails."""
    model = llm.llm_engine.model_runner.model
    real_run_layers = model.run_layers

    def run_layers(input_ids, *args, **kwargs):  # the combine's forward (a plain forward goes through it too)
        if (input_ids == POISON).any():
            raise RuntimeError(f"token {POISON} breaks this combine")
        return real_run_layers(input_ids, *args, **kwargs)

    tokenizer = llm.get_tokenizer()
    docs = [("pic", tokenizer.encode(" Paris is the capital of France.")), ("pic", tokenizer.encode(" Rome is in Italy."))]
    good = [("regular", tokenizer.encode("Read:"))] + docs + [("regular", tokenizer.encode(" Which city?"))]
    broken = [("regular", tokenizer.encode("Read:"))] + docs + [("regular", [POISON, 5, 6])]
    [pic_expected] = [o.outputs[0].token_ids for o in llm.generate({"segments": good}, GREEDY, pic_backend="full")]
    assert POISON not in pic_expected
    executor = llm.llm_engine.model_runner.pic_executor
    forwards_before = executor.stats.combine_forwards
    monkeypatch.setattr(model, "run_layers", run_layers)
    outputs = llm.generate([PROMPTS[0], {"segments": broken}, {"segments": good}, PROMPTS[1]], GREEDY,
                           pic_backend="full")
    assert_only_the_culprit_failed(llm, outputs, 1, [expected[0], pic_expected, expected[1]],
                                   f"token {POISON} breaks this combine")
    assert "combine of 2 requests failed" in caplog.text  # both were in one forward
    assert executor.stats.combine_forwards - forwards_before == 1  # the good request, alone after the batch failed


def test_a_failing_n_request_fails_whole_and_prompt_logprobs_never_outlive_a_failed_request(
        llm, expected, poisoned_forward):
    """Every completion of an n > 1 request whose forward breaks fails, and the request with them; a request
    whose sampling fails after its prompt logprobs were computed in the same step fails alone."""
    poisoned_forward(llm)
    n_params = SamplingParams(n=2, max_tokens=10, temperature=0.7, seed=1, prompt_logprobs=1)
    outputs = llm.generate([PROMPTS[0], PROMPTS[1], {"prompt_token_ids": [11, POISON, 13]}, PROMPTS[2]],
                           [GREEDY, GREEDY, n_params, GREEDY])
    assert_only_the_culprit_failed(llm, outputs, 2, expected, f"token {POISON} breaks this batch")
    late_failure = SamplingParams(max_tokens=10, temperature=0.7, seed=1, prompt_logprobs=1)
    object.__setattr__(late_failure, "seed", 2 ** 64)  # as unbuildable_seed(): fails in the sampler
    outputs = llm.generate(PROMPTS[:1] + ["poisoned"] + PROMPTS[1:], [GREEDY, late_failure, GREEDY, GREEDY])
    assert_only_the_culprit_failed(llm, outputs, 1, expected, "Overflow")
    assert not llm.llm_engine._parents and not llm.llm_engine._sequences

"""PIC requests in the scheduler, through a real engine on a tiny checkpoint: a PIC prompt that
does not fit a step does not hold up the queue, and a preempted PIC request resumes with PIC, its output unchanged.
Progress is counted in engine steps, never in time."""

from __future__ import annotations

import pytest

from nebula_engine import LLM
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.pic.segments import segment_token_lists
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)
from tests.pic.test_backends_exact import flat, rag_prompt

PAGE_SIZE = 4
BIG_POOL = 512  # pages: nothing is ever preempted
SPEC = "naive"  # reuses every segment as cached, unrepaired: its output differs from plain prefill's
QWEN3 = "qwen3_gqa2_hd20"


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def plain_prompt(length: int, seed: int) -> list[int]:
    return [(seed + 37 * i) % 900 + 100 for i in range(length)]


class StepLog:
    """Drives an engine one step at a time; records the step of each request's first token and its final output."""

    def __init__(self, llm: LLM):
        self.engine = llm.llm_engine
        self.step_count = 0
        self.added_at: dict[str, int] = {}
        self.first_token_at: dict[str, int] = {}
        self.finished = {}

    def add(self, request_id: str, prompt, params: SamplingParams, pic_backend=None) -> None:
        self.engine.add_request(request_id, prompt, params, pic_backend=pic_backend)
        self.added_at[request_id] = self.step_count

    def step(self) -> None:
        self.step_count += 1
        for output in self.engine.step():
            self.first_token_at.setdefault(output.request_id, self.step_count)
            if output.finished:
                self.finished[output.request_id] = output

    def run_until_idle(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


@pytest.fixture(scope="module")
def alone(checkpoint_factory):
    """``alone(case, spec)``: the checkpoint, the PIC request of these tests, its output run alone in an engine that
    never preempts, and its plain-prefill twin's."""
    cache = {}

    def get(case_name: str, spec: str):
        if (case_name, spec) not in cache:
            checkpoint = str(checkpoint_factory(CASES_BY_NAME[case_name]))
            llm = LLM(checkpoint, page_size=PAGE_SIZE, num_pages=BIG_POOL, enable_prefix_caching=False)
            segments = rag_prompt(seed=2, order=(1, 2, 0))
            pic = llm.generate({"segments": segments}, greedy(48), pic_backend=spec, use_tqdm=False)[0]
            plain = llm.generate({"prompt_token_ids": flat(segments)}, greedy(48), pic_backend=None,
                                 use_tqdm=False)[0]
            cache[case_name, spec] = checkpoint, segment_token_lists(segments), pic, plain
        return cache[case_name, spec]
    return get


def assert_same_output(output, reference) -> None:
    assert output.outputs[0].token_ids == reference.outputs[0].token_ids
    assert output.outputs[0].token_logprobs == pytest.approx(reference.outputs[0].token_logprobs, abs=1e-4)


def test_pic_prompt_over_the_budget_does_not_block_a_small_request_behind_it(alone):
    checkpoint, prompt, reference, _ = alone(QWEN3, SPEC)
    max_num_batched_tokens = 64
    assert len(prompt.token_ids) > max_num_batched_tokens  # its combine can only run alone
    llm = LLM(checkpoint, page_size=PAGE_SIZE, num_pages=BIG_POOL, enable_prefix_caching=False,
              max_num_batched_tokens=max_num_batched_tokens)
    log = StepLog(llm)
    log.add("running", plain_prompt(8, seed=1), greedy(20))
    log.step()
    log.add("pic", prompt, greedy(48), pic_backend=SPEC)
    log.add("small", plain_prompt(10, seed=2), greedy(4))
    log.step()
    assert log.first_token_at["small"] == log.added_at["small"] + 1  # admitted past the waiting PIC prompt
    assert [s.seq_id for s in llm.llm_engine.scheduler.waiting] == ["pic"]
    log.run_until_idle()
    # it ran once the running set drained, and is not changed by having waited
    assert log.first_token_at["pic"] > log.first_token_at["small"]
    assert log.finished["running"].outputs[0].token_ids and log.finished["small"].outputs[0].token_ids
    assert_same_output(log.finished["pic"], reference)


# (model case, an approximate spec for it, prefix caching); hybrid models run without prefix caching
PREEMPTION_CASES = [(QWEN3, SPEC, False), (QWEN3, SPEC, True), ("qwen3_5_linear_full_linear", "hypic:seam=3", False),
                    ("deepseek_v2_lite_greedy_yarn", SPEC, False)]


@pytest.mark.parametrize("case_name,spec,prefix_caching", PREEMPTION_CASES,
                         ids=[f"{c}-{s.split(':')[0]}-{'prefix-cache' if p else 'no-prefix-cache'}"
                              for c, s, p in PREEMPTION_CASES])
def test_preempted_pic_request_resumes_with_pic_and_its_output_is_unchanged(alone, case_name, spec, prefix_caching):
    checkpoint, prompt, reference, plain = alone(case_name, spec)
    # the precondition that makes the check meaningful: a plain recompute would change the output
    assert max(abs(a - b) for a, b in zip(reference.outputs[0].token_logprobs, plain.outputs[0].token_logprobs)) > 1e-3
    # 72 pages: the running request's 31, the PIC prompt's 20 and its 3 segments' 18 at admission; both grow
    # until the PIC request, the newest, is preempted; it resumes when the other one finishes
    llm = LLM(checkpoint, page_size=PAGE_SIZE, num_pages=72, enable_prefix_caching=prefix_caching,
              max_num_batched_tokens=128)
    executor = llm.llm_engine.model_runner.pic_executor
    log = StepLog(llm)
    log.add("other", plain_prompt(120, seed=3), greedy(60))
    log.step()
    log.add("pic", prompt, greedy(48), pic_backend=spec)
    seq = llm.llm_engine._sequences["pic"]
    log.run_until_idle()
    assert seq.num_preemptions >= 1
    if not prefix_caching:  # with it, the request may resume from its own pages, still cached: no combine needed
        assert executor.stats.combines == 1 + seq.num_preemptions
    assert executor.stats.segment_skipped == 0  # its segments were found or stored again, never left out
    output = log.finished["pic"]
    assert_same_output(output, reference)
    assert output.num_pic_cached_tokens == reference.num_pic_cached_tokens  # the first combine's counts

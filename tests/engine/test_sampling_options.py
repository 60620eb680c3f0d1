"""vLLM's sampling options through LLM.generate on a tiny Qwen3, each against the same request without it:
n, logit_bias, min_tokens, penalties, logprobs (checked against transformers' logits), PIC requests included."""

import pytest
import torch

from nebula_engine import SamplingParams

PROMPT = "The quick brown fox jumps over"
PIC_PROMPT = "Notes: <pic>Paris is the capital of France.</pic> <pic>Rome is in Italy.</pic> Question: where?"


def greedy(max_tokens=12, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=kwargs.pop("ignore_eos", True), **kwargs)


def completion(llm, prompt, params):
    return llm.generate(prompt, params)[0].outputs[0]


def test_n_gives_n_indexed_completions_each_as_its_seeded_single_request(llm):
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    [out] = llm.generate(PROMPT, params)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    again = llm.generate(PROMPT, params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    for i, c in enumerate(out.outputs):  # vLLM's parallel sampling: completion i is the request seeded seed + i
        single = completion(llm, PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=5 + i, ignore_eos=True))
        assert c.token_ids == single.token_ids and c.text == single.text
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_n_with_a_pic_prompt_and_next_to_other_requests(llm):
    params = SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=1, ignore_eos=True)
    outputs = llm.generate([PIC_PROMPT, PROMPT], [params, greedy(6)])
    assert [len(o.outputs) for o in outputs] == [2, 1]
    alone = llm.generate(PIC_PROMPT, params)[0]
    assert [c.token_ids for c in outputs[0].outputs] == [c.token_ids for c in alone.outputs]
    assert outputs[1].outputs[0].token_ids == completion(llm, PROMPT, greedy(6)).token_ids
    assert not llm.llm_engine.has_unfinished_requests()


def test_logit_bias_forces_a_token_and_leaves_others_alone(llm):
    plain = completion(llm, PROMPT, greedy())
    forced = next(t for t in range(100, 200) if t not in plain.token_ids)
    biased = completion(llm, PROMPT, greedy(logit_bias={forced: 100.0}))
    assert biased.token_ids == [forced] * 12
    assert completion(llm, PROMPT, greedy(logit_bias={forced: 0.0})).token_ids == plain.token_ids
    first = plain.token_ids[0]
    banned = completion(llm, PROMPT, greedy(logit_bias={first: -100.0}))
    assert first not in banned.token_ids
    pic = completion(llm, PIC_PROMPT, greedy(logit_bias={forced: 100.0}))
    assert pic.token_ids == [forced] * 12


def test_min_tokens_delays_stop_tokens_and_eos(llm, monkeypatch):
    plain = completion(llm, PROMPT, greedy())
    stop = plain.token_ids[1]
    stopped = completion(llm, PROMPT, greedy(stop_token_ids=[stop]))
    assert len(stopped.token_ids) == plain.token_ids.index(stop) + 1
    delayed = completion(llm, PROMPT, greedy(stop_token_ids=[stop], min_tokens=6))
    assert len(delayed.token_ids) >= 6 and stop not in delayed.token_ids[:6]
    assert delayed.token_ids[:1] == plain.token_ids[:1]
    eos = plain.token_ids[1]
    monkeypatch.setattr(llm.llm_engine.output_processor, "eos_token_ids", {eos})
    monkeypatch.setattr(llm.llm_engine.model_runner.sampler, "eos_token_ids", (eos,))
    assert len(completion(llm, PROMPT, greedy(ignore_eos=False)).token_ids) == plain.token_ids.index(eos) + 1
    late = completion(llm, PROMPT, greedy(ignore_eos=False, min_tokens=6))
    assert len(late.token_ids) >= 6 and eos not in late.token_ids[:6]


def repeats(prompt_ids, output_ids) -> int:
    """Output tokens already seen in the prompt or earlier in the output."""
    seen, count = set(prompt_ids), 0
    for token in output_ids:
        count += token in seen
        seen.add(token)
    return count


def test_repetition_penalty_reduces_repeats_and_below_one_increases_them(llm):
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    plain = completion(llm, PROMPT, greedy(24))
    penalized = completion(llm, PROMPT, greedy(24, repetition_penalty=3.0))
    encouraged = completion(llm, PROMPT, greedy(24, repetition_penalty=0.3))
    assert repeats(prompt_ids, penalized.token_ids) < repeats(prompt_ids, plain.token_ids)
    assert repeats(prompt_ids, encouraged.token_ids) > repeats(prompt_ids, plain.token_ids)


def test_frequency_and_presence_penalties_count_only_generated_tokens(llm):
    plain = completion(llm, PROMPT, greedy(24))
    for field in ("frequency_penalty", "presence_penalty"):
        penalized = completion(llm, PROMPT, greedy(24, **{field: 2.0}))
        assert repeats([], penalized.token_ids) < repeats([], plain.token_ids), field
    # a prompt token is never penalized by them: the first generated token is unchanged
    assert completion(llm, PROMPT, greedy(1, frequency_penalty=2.0)).token_ids == plain.token_ids[:1]


def transformers_logprobs(checkpoint, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of ``token_ids`` [len, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_logprob_dicts_match(dicts, reference: torch.Tensor, sampled: list[int], k: int, tokenizer) -> None:
    for position, (entry, token) in enumerate(zip(dicts, sampled)):
        row = reference[position]
        top = row.topk(k).indices.tolist()
        assert set(entry) == {token, *top}
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(row[token_id].item(), abs=2e-4)
            # rank: tokens at least as likely; a margin for the engine's and transformers' rounding differences
            value = row[token_id]
            assert int((row > value + 2e-4).sum()) + 1 <= logprob.rank <= int((row >= value - 2e-4).sum())
            assert logprob.decoded_token == tokenizer.decode([token_id])


def test_logprobs_are_the_log_softmax_of_the_models_logits(llm, qwen3_dir):
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=2, ignore_eos=True, logprobs=3)
    out = completion(llm, PROMPT, params)
    assert len(out.logprobs) == 6
    reference = transformers_logprobs(qwen3_dir, prompt_ids + out.token_ids)[len(prompt_ids) - 1:-1]
    assert_logprob_dicts_match(out.logprobs, reference, out.token_ids, 3, llm.get_tokenizer())
    assert out.cumulative_logprob == pytest.approx(sum(out.token_logprobs), abs=1e-5)
    assert completion(llm, PROMPT, params.for_completion(0)).token_ids == out.token_ids  # same seed, same tokens
    plain = completion(llm, PROMPT, SamplingParams(max_tokens=6, temperature=0.9, seed=2, ignore_eos=True))
    assert plain.logprobs is None and plain.cumulative_logprob is None and plain.token_ids == out.token_ids
    only_sampled = completion(llm, PROMPT, greedy(3, logprobs=0))
    assert [list(d) for d in only_sampled.logprobs] == [[t] for t in only_sampled.token_ids]


def test_logprobs_of_a_pic_request_follow_its_sampled_tokens(llm):
    out = completion(llm, PIC_PROMPT, greedy(5, logprobs=2))
    for entry, token, logprob in zip(out.logprobs, out.token_ids, out.token_logprobs):
        assert entry[token].logprob == pytest.approx(logprob) and entry[token].rank == 1  # greedy: the top token
        assert len(entry) == 2


@pytest.mark.parametrize("fields, message", [
    (dict(logit_bias={10 ** 6: 1.0}), "logit_bias token id"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token id"),
])
def test_engine_checks_token_ids_against_the_vocabulary(llm, fields, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPT, SamplingParams(**fields))


@pytest.mark.parametrize("fields", [
    dict(n=0), dict(n=129), dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(repetition_penalty=0.0),
    dict(repetition_penalty=-1.0), dict(min_p=1.5), dict(min_tokens=-1), dict(min_tokens=17), dict(logprobs=2 ** 31),
    dict(logprobs=-1), dict(prompt_logprobs=2 ** 31), dict(logit_bias={1: float("nan")}), dict(logit_bias={"1": 2.0}),
    dict(logit_bias=[1, 2]),
], ids=str)
def test_out_of_range_options_are_value_errors_naming_the_field(fields):
    name = next(iter(fields))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)


@pytest.mark.parametrize("prompt", [PROMPT, PIC_PROMPT, "one two three four five six seven eight nine ten " * 12],
                         ids=["short", "pic", "chunked"])
def test_prompt_logprobs_are_those_of_the_exact_full_prefill(llm, qwen3_dir, prompt):
    """The shared engine prefills in 64-token chunks; a prompt run before is in the prefix cache and a PIC prompt
    would be combined: prompt logprobs still come from every prompt token's own full-prefill hidden state."""
    llm.generate(prompt, greedy(1))  # now cached (prefix cache, PIC store)
    [out] = llm.generate(prompt, greedy(2, prompt_logprobs=2))
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    reference = transformers_logprobs(qwen3_dir, ids)[:-1]
    assert_logprob_dicts_match(out.prompt_logprobs[1:], reference, ids[1:], 2, llm.get_tokenizer())
    assert out.num_cached_tokens == 0
    plain = llm.generate(prompt, greedy(2))[0]
    assert plain.prompt_logprobs is None
    exact = llm.generate(prompt, greedy(2), pic_backend=None)[0]  # no PIC combine: the tokens of the full prefill
    assert out.outputs[0].token_ids == exact.outputs[0].token_ids

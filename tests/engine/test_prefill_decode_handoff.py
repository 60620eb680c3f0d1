"""Prefill -> decode hand-off between two engines, as a cluster does it: engine A prefills with ``hold_kv`` and stops
after the first token; its pages are copied into pages engine B reserved (a tensor copy, as NIXL would) and, for a
hybrid model, its linear-attention state goes along; B continues with ``add_prefilled``. Greedy decoding must equal
one engine's, token for token."""

from dataclasses import replace

import pytest
import torch

from nebula_engine import LLM, SamplingParams
from nebula_engine.engine.kv_plan import KVPlan
from nebula_engine.pic.segments import SegmentedPrompt, segment_token_lists
from tests.model_cases import CASES_BY_NAME

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SETTINGS = dict(page_size=8, num_pages=160, max_num_batched_tokens=64)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["qwen3_5_linear_full_linear", "qwen3_gqa2_hd20"])
def engines(request, checkpoint_factory):
    """A prefill engine and a decode engine of one tiny model (hybrid Qwen3.5, and an attention-only control)."""
    checkpoint = str(checkpoint_factory(CASES_BY_NAME[request.param]))
    return LLM(checkpoint, **SETTINGS).llm_engine, LLM(checkpoint, **SETTINGS).llm_engine


def run(engine, request_id: str):
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output


def prefill_and_hold(engine, request_id: str, prompt: list[int]):
    engine.add_request(request_id, prompt, replace(GREEDY, max_tokens=1), kv_plan=KVPlan(hold=True))
    return run(engine, request_id).outputs[0]


def copy_pages(source, source_pages: list[int], target, target_pages: list[int]) -> None:
    for source_layer, target_layer in zip(source.model_runner.kv_storage.layer_caches,
                                          target.model_runner.kv_storage.layer_caches):
        for source_tensor, target_tensor in zip(source_layer, target_layer):
            target_tensor[target_pages] = source_tensor[source_pages]


def hand_off(prefill, decode, request_id: str, prompt: list[int] | SegmentedPrompt):
    first = prefill_and_hold(prefill, request_id, prompt)
    token_ids = list(prompt.token_ids if isinstance(prompt, SegmentedPrompt) else prompt)
    pages = decode.reserve_prefilled(request_id, len(token_ids))
    copy_pages(prefill, prefill.held_block_table(request_id), decode, pages)
    state = prefill.held_linear_state(request_id)
    prefill.release_held(request_id)
    decode.add_prefilled(request_id, token_ids, first.token_ids[0], first.token_logprobs[0], GREEDY,
                         linear_state=state)
    return run(decode, request_id).outputs[0]


def assert_same_decode(handed, alone) -> None:
    assert handed.token_ids == alone.token_ids
    torch.testing.assert_close(torch.tensor(handed.token_logprobs), torch.tensor(alone.token_logprobs),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("length", [37, 150])  # one prefill step; chunked, past a prefix-cache checkpoint
def test_handed_off_decode_equals_single_engine_decode(engines, length):
    prefill, decode = engines
    prompt = random_tokens(length, seed=length)
    decode.add_request(f"alone-{length}", prompt, GREEDY)  # on the decode engine: the prefill one starts cold
    alone = run(decode, f"alone-{length}").outputs[0]
    assert_same_decode(hand_off(prefill, decode, f"handed-{length}", prompt), alone)


def test_a_handed_off_pic_combine_decodes_as_on_one_engine(engines):
    """The engines' default PIC backend: HYPIC for the hybrid (its combine writes the state the hand-off carries),
    EPIC otherwise; both engines start without the segments cached."""
    prefill, decode = engines
    prompt = segment_token_lists([("regular", random_tokens(4, seed=30)), ("pic", random_tokens(24, seed=31)),
                                  ("pic", random_tokens(24, seed=32)), ("regular", random_tokens(8, seed=33))])
    decode.add_request("pic-alone", prompt, GREEDY)
    alone = run(decode, "pic-alone").outputs[0]
    combines = prefill.model_runner.pic_executor.stats.combines
    assert_same_decode(hand_off(prefill, decode, "pic-handed", prompt), alone)
    assert prefill.model_runner.pic_executor.stats.combines == combines + 1


def test_the_state_is_held_with_the_pages_and_freed_with_them(engines):
    prefill, decode = engines
    slots = prefill.scheduler.kv_cache.state_slots
    if slots is None:
        prefill_and_hold(prefill, "plain", random_tokens(20, seed=7))
        assert prefill.held_linear_state("plain") == {}
        prefill.release_held("plain")
        return
    free = slots.num_free
    prefill_and_hold(prefill, "held", random_tokens(20, seed=7))
    assert slots.num_free == free - 1  # the finished request keeps its slot until the decode peer has read it
    state = prefill.held_linear_state("held")
    layers = prefill.model_runner.kv_storage.linear_states
    assert len(state["conv"]) == len(state["recurrent"]) == len(layers)
    assert all(t.device.type == "cpu" for t in state["conv"] + state["recurrent"])
    prefill.release_held("held")
    assert slots.num_free == free


def test_a_hybrid_decode_engine_refuses_a_prefilled_request_without_state_and_frees_its_slot(engines):
    prefill, decode = engines
    slots = decode.scheduler.kv_cache.state_slots
    if slots is None:
        pytest.skip("attention-only model: there is no state to carry")
    free, free_pages = slots.num_free, decode.scheduler.kv_cache.num_free_pages
    decode.reserve_prefilled("stateless", 20)
    assert slots.num_free == free - 1
    with pytest.raises(ValueError, match="linear-attention state"):
        decode.add_prefilled("stateless", random_tokens(20, seed=8), 5, -1.0, GREEDY)
    bad = {"conv": [torch.zeros(1)], "recurrent": [torch.zeros(1)]}
    with pytest.raises(ValueError, match="does not fit"):
        decode.add_prefilled("stateless", random_tokens(20, seed=8), 5, -1.0, GREEDY, linear_state=bad)
    decode.cancel_prefilled("stateless")
    assert (slots.num_free, decode.scheduler.kv_cache.num_free_pages) == (free, free_pages)

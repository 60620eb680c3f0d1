"""``n > 1``, top logprobs, prompt logprobs and completions' ``echo`` through a cluster, as a single engine gives them.

First the front end alone (the test plays the leader and the serving peers on a real engine), then a real local
cluster (one prefill and one decode peer: a request with more than one token is handed off) over HTTP, against one
engine on the same weights.
"""

from __future__ import annotations

import asyncio
import math

import pytest
from builders import Clock

from nebula_engine import LLM, SamplingParams
from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.frontend import ClusterFrontend
from nebula_engine.cluster.runtime.launcher import LocalCluster, local_spec
from nebula_engine.cluster.runtime.liveness import Liveness
from nebula_engine.cluster.runtime.transfer import nixl_available
from nebula_engine.cluster.runtime.worker_codec import OutputStream, params_from_wire
from nebula_engine.engine.outputs import Logprob, RequestOutput
from nebula_engine.engine.request_port import RequestPort
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)

PEERS = ["front", "prefill-0", "decode-0"]
TOLERANCE = 1e-4
ENGINE = {"page_size": 4, "num_pages": 512}
pytestmark = pytest.mark.xdist_group("cluster")  # the group of the tests that start peer processes


# ---- the front end alone ----
class Peers:
    """One front end ("front") whose submissions the test receives and runs on ``engine``."""

    def __init__(self, engine):
        self.engine, self.clock = engine, Clock()
        self.sent: asyncio.Queue = asyncio.Queue()
        self.liveness = Liveness("front", PEERS, dead_after_s=3.0, clock=self.clock)
        self.front = ClusterFrontend("front", RequestPort(engine),
                                     lambda peer, msg: self.sent.put_nowait((peer, msg)),
                                     lambda: "prefill-0", lambda: True, ["prefill-0"], self.liveness,
                                     failover_timeout_s=10.0)

    async def final(self, request_id: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
        last = None
        async for last in self.front.generate(request_id, prompt, params):
            pass
        return last

    async def next_submit(self) -> wire.Submit:
        while True:
            _, message = await asyncio.wait_for(self.sent.get(), 10)
            if isinstance(message, wire.Submit):
                return message

    async def serve(self, submit: wire.Submit, server: str, limit: int | None = None) -> None:
        """Run ``submit`` as peer ``server`` streams it (``OutputStream``), passing on at most ``limit`` outputs."""
        stream = OutputStream(server, submit.request_id, submit.attempt)
        count = 0
        async for output in self.engine.generate(f"{submit.request_id}#{submit.attempt}", submit.token_ids,
                                                 params_from_wire(submit.params)):
            self.liveness.heard(server)
            self.front.on_output(stream.message(output))
            count += 1
            if count == limit:
                return
            await asyncio.sleep(0)

    def kill(self, peer: str) -> None:
        self.clock.now += self.liveness.dead_after_s + 0.5
        for other in PEERS:
            if other != peer:
                self.liveness.heard(other)
        self.front.check()


async def engine_final(engine, request_id: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
    return [o async for o in engine.generate(request_id, prompt, params)][-1]


def assert_positions_close(got, expected) -> None:
    """Per position, the same candidates with the same ranks and texts, logprobs within ``TOLERANCE``."""
    assert len(got) == len(expected)
    for position, reference in zip(got, expected):
        if reference is None:
            assert position is None
            continue
        assert position.keys() == reference.keys()
        for token_id, logprob in reference.items():
            assert (position[token_id].rank, position[token_id].decoded_token) == (logprob.rank, logprob.decoded_token)
            assert math.isclose(position[token_id].logprob, logprob.logprob, abs_tol=TOLERANCE)


def test_top_and_prompt_logprobs_reach_the_client_as_the_engine_gives_them(engine):
    prompt = engine.tokenizer.encode("The owl sat on the branch and")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)

    async def scenario():
        peers = Peers(engine)
        client = asyncio.ensure_future(peers.final("r", prompt, params))
        peers_task = asyncio.ensure_future(peers.serve(await peers.next_submit(), "prefill-0"))
        got = await client
        await peers_task
        return got, await engine_final(engine, "reference", prompt, params)

    got, reference = asyncio.run(scenario())
    assert got.outputs[0].token_ids == reference.outputs[0].token_ids
    assert got.outputs[0].logprobs == reference.outputs[0].logprobs  # the same engine: exactly
    assert got.outputs[0].cumulative_logprob == reference.outputs[0].cumulative_logprob
    assert got.prompt_logprobs == reference.prompt_logprobs and got.prompt_logprobs[0] is None


def test_top_logprobs_continue_unbroken_after_the_serving_peer_dies(engine):
    prompt = engine.tokenizer.encode("Five six seven")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)

    async def scenario():
        peers = Peers(engine)
        client = asyncio.ensure_future(peers.final("r", prompt, params))
        await peers.serve(await peers.next_submit(), "decode-0", limit=3)
        peers.kill("decode-0")
        again = await peers.next_submit()
        assert again.attempt == 1 and params_from_wire(again.params).prompt_logprobs is None  # reported already
        await peers.serve(again, "prefill-0")
        return await client, await engine_final(engine, "reference", prompt, params)

    got, reference = asyncio.run(scenario())
    assert got.outputs[0].token_ids == reference.outputs[0].token_ids
    assert_positions_close(got.outputs[0].logprobs, reference.outputs[0].logprobs)
    assert got.prompt_logprobs == reference.prompt_logprobs


def test_n_completions_are_submitted_each_as_the_engine_samples_them_and_gathered_in_order(engine):
    prompt = engine.tokenizer.encode("One two three")
    params = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=11, ignore_eos=True, logprobs=1)

    async def scenario():
        peers = Peers(engine)
        client = asyncio.ensure_future(peers.final("r", prompt, params))
        submits = [await peers.next_submit(), await peers.next_submit()]
        assert [s.request_id for s in submits] == ["0_r", "1_r"]
        assert [params_from_wire(s.params) for s in submits] == [params.for_completion(0), params.for_completion(1)]
        await asyncio.gather(*(peers.serve(s, "prefill-0") for s in reversed(submits)))
        return await client, await engine_final(engine, "reference", prompt, params)

    got, reference = asyncio.run(scenario())
    assert got.request_id == "r" and got.finished
    assert [c.index for c in got.outputs] == [0, 1]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in reference.outputs]
    assert [c.text for c in got.outputs] == [c.text for c in reference.outputs]


def test_an_n_request_id_taken_by_a_completion_of_another_is_refused(engine):
    async def scenario():
        peers = Peers(engine)
        first = asyncio.ensure_future(peers.final("r", [5, 6, 7], SamplingParams(n=2, max_tokens=2)))
        await peers.next_submit()
        with pytest.raises(ValueError, match="'0_r' is already in use"):
            await peers.final("0_r", [5, 6, 7], SamplingParams(max_tokens=2))
        first.cancel()

    asyncio.run(scenario())


def test_sampling_fields_of_an_output_survive_the_wire():
    top = [[wire.Candidate(7, -0.25, 1, "a"), wire.Candidate(9, float("-inf"), 3, None)]]
    output = wire.Output(sender="p", request_id="r", attempt=1, text="a", token_ids=[7], logprobs=[-0.25],
                         finished=False, finish_reason=None, stop_reason=None, cached=[0, 0, 0, 0],
                         top_logprobs=top, top_logprobs_start=4, prompt_logprobs=[None, top[0]])
    assert wire.decode(wire.encode(output)) == output


def test_an_output_stream_sends_each_position_once_and_the_prompt_logprobs_first():
    def output(num_tokens: int) -> RequestOutput:
        from nebula_engine.engine.outputs import CompletionOutput
        positions = [{t: Logprob(-1.0 * t, 1, str(t))} for t in range(num_tokens)]
        return RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", list(range(num_tokens)), logprobs=positions,
                                                                  token_logprobs=[0.0] * num_tokens)],
                             prompt_logprobs=[None, {2: Logprob(-0.5, 1, "2")}])

    stream = OutputStream("d", "r", 0, first_position=1)
    first, second = stream.message(output(2)), stream.message(output(3))
    assert (first.top_logprobs_start, [[c.token_id for c in p] for p in first.top_logprobs]) == (1, [[0], [1]])
    assert (second.top_logprobs_start, [[c.token_id for c in p] for p in second.top_logprobs]) == (3, [[2]])
    assert first.prompt_logprobs == [None, [wire.Candidate(2, -0.5, 1, "2")]] and second.prompt_logprobs is None


# ---- a real cluster ----
@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"]))


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """One prefill and one decode peer: every request of more than one token is handed off."""
    if not nixl_available():
        pytest.skip("NIXL is not installed")
    spec = local_spec(1, 1, remote_read_latency_s=0.0, scatter_dispatch_s=0.0, shared_cores=False,
                      observe_transfer_costs=False)
    with LocalCluster(model_dir, spec, ENGINE, log_dir=tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture(scope="module")
def single(model_dir):
    return LLM(model_dir, **ENGINE)


PROMPT = [17, 230, 45, 812, 99, 301, 12, 640, 77]


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **fields)


def complete(cluster, model_dir, **fields) -> dict:
    from test_cluster_e2e import post
    body = {"model": model_dir, "prompt": PROMPT, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, **fields}
    status, reply = post(cluster.urls["prefill-0"], "/v1/completions", body, key=None)
    assert status == 200, reply
    return reply


def top_by_name(position: dict[int, Logprob], k: int) -> dict[str, float]:
    """The ``k`` most likely of a position as completions name them (``return_tokens_as_token_ids``)."""
    ranked = sorted(position.items(), key=lambda item: -item[1].logprob)[:k]
    return {f"token_id:{token_id}": p.logprob for token_id, p in ranked}


def assert_close(got: dict[str, float], expected: dict[str, float]) -> None:
    assert got.keys() == expected.keys()
    assert all(math.isclose(got[name], expected[name], abs_tol=TOLERANCE) for name in expected), (got, expected)


def test_n_2_returns_two_completions(cluster, model_dir, single):
    reply = complete(cluster, model_dir, n=2, max_tokens=4)
    reference = single.generate({"prompt_token_ids": PROMPT}, greedy(max_tokens=4))[0]
    assert sorted(c["index"] for c in reply["choices"]) == [0, 1]
    assert [c["text"] for c in reply["choices"]] == [reference.outputs[0].text] * 2
    assert reply["usage"]["completion_tokens"] == 8


def test_top_logprobs_of_a_handed_off_request_equal_a_single_engine_s(cluster, model_dir, single):
    k = 3
    before = cluster.state("decode-0")["transfer_bytes"]
    reply = complete(cluster, model_dir, max_tokens=5, logprobs=k)
    assert cluster.state("decode-0")["transfer_bytes"] > before  # decoded after a hand-off
    reference = single.generate({"prompt_token_ids": PROMPT}, greedy(max_tokens=5, logprobs=k))[0].outputs[0]
    logprobs = reply["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in reference.token_ids]
    assert len(logprobs["top_logprobs"]) == 5
    for got, position in zip(logprobs["top_logprobs"], reference.logprobs):
        assert_close(got, top_by_name(position, k))
    assert all(math.isclose(got, position[t].logprob, abs_tol=TOLERANCE)
               for got, t, position in zip(logprobs["token_logprobs"], reference.token_ids, reference.logprobs))


def test_prompt_logprobs_equal_a_single_engine_s(cluster, model_dir, single):
    reply = complete(cluster, model_dir, max_tokens=3, prompt_logprobs=2)
    reference = single.generate({"prompt_token_ids": PROMPT}, greedy(max_tokens=3, prompt_logprobs=2))[0]
    got = reply["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT)
    for position, expected in zip(got[1:], reference.prompt_logprobs[1:]):
        assert {int(t): p["rank"] for t, p in position.items()} == {t: p.rank for t, p in expected.items()}
        assert all(math.isclose(position[str(t)]["logprob"], p.logprob, abs_tol=TOLERANCE)
                   for t, p in expected.items())
    assert reply["choices"][0]["text"] == reference.outputs[0].text


def test_echo_with_no_tokens_scores_the_prompt_as_a_single_engine(cluster, model_dir, single):
    reply = complete(cluster, model_dir, max_tokens=0, echo=True, logprobs=1)
    reference = single.generate({"prompt_token_ids": PROMPT}, greedy(max_tokens=1, prompt_logprobs=1))[0]
    choice = reply["choices"][0]
    assert choice["text"] == single.get_tokenizer().decode(PROMPT)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in PROMPT]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = [position[t].logprob for t, position in zip(PROMPT[1:], reference.prompt_logprobs[1:])]
    assert all(math.isclose(got, e, abs_tol=TOLERANCE) for got, e in zip(logprobs["token_logprobs"][1:], expected))
    for got, position in zip(logprobs["top_logprobs"][1:], reference.prompt_logprobs[1:]):
        assert_close(got, top_by_name(position, 1))

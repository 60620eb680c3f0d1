import heapq
import itertools

import pytest

from nebula_engine.cluster.control.config import ClusterProfile, PrefillTimeModel
from nebula_engine.cluster.sim.hardware import Links, SharedProcessor, make_processors


class Clock:
    """A tiny event loop: what the simulator gives its hardware."""

    def __init__(self):
        self.heap, self.tick, self.done = [], itertools.count(), {}

    def at(self, time, action):
        heapq.heappush(self.heap, (time, next(self.tick), action))

    def run(self):
        while self.heap:
            time, _, action = heapq.heappop(self.heap)
            action(time)


def test_forwards_sharing_a_processor_slow_each_other_down():
    clock = Clock()
    shared = SharedProcessor(clock.at)
    shared.start(0, 1.0, lambda t: clock.done.setdefault("a", t), now=0.0)
    shared.start(1, 1.0, lambda t: clock.done.setdefault("b", t), now=0.5)
    clock.run()
    # a runs alone for 0.5 s, then both at half speed: a ends at 1.5, b has 0.5 left alone -> 2.0
    assert clock.done == {"a": pytest.approx(1.5), "b": pytest.approx(2.0)}


def test_gpu_workers_have_a_processor_each_cpu_workers_share_one():
    gpu = ClusterProfile.load("default")
    assert len({id(p) for p in make_processors(gpu, 4, Clock().at)}) == 4
    from dataclasses import replace
    cpu = replace(gpu, shared_compute=True, gpus_per_node=64)
    assert len({id(p) for p in make_processors(cpu, 4, Clock().at)}) == 1


def test_transfers_through_one_port_queue_behind_each_other():
    profile = ClusterProfile.load("default")
    links = Links(profile)
    size = 22e9  # one second on the inter-node NIC
    first = links.transfer(0, 4, size, now=0.0)
    second = links.transfer(1, 4, size, now=0.0)  # same receiving NIC on worker 4
    third = links.transfer(2, 5, size, now=0.0)  # other ports: no wait
    latency = profile.inter_node.latency_s
    assert first == pytest.approx(1.0 + latency) and second == pytest.approx(2 * (1.0 + latency))
    assert third == pytest.approx(first)
    assert links.transfer(0, 0, size, now=3.0) == 3.0  # no link to itself


def test_a_batched_forward_pays_the_fixed_cost_once():
    model = PrefillTimeModel(fixed_s=0.01, per_token_s=1e-4, attention_s=1e-8)
    batch = model.batch_seconds([(1000, 0), (500, 2000)])
    assert batch == pytest.approx(model.seconds(1000) + model.seconds(500, 2000) - model.fixed_s)
    assert model.batch_seconds([]) == 0.0


def test_a_shared_machine_with_two_cores_runs_two_forwards_side_by_side():
    clock = Clock()
    shared = SharedProcessor(clock.at, capacity=2.0)  # times in single-core seconds
    shared.start(0, 1.0, lambda t: clock.done.setdefault("a", t), now=0.0)
    clock.run()
    shared.start(0, 1.0, lambda t: clock.done.setdefault("b", t), now=1.0)
    shared.start(1, 1.0, lambda t: clock.done.setdefault("c", t), now=1.0)
    clock.run()
    assert clock.done == {"a": pytest.approx(0.5), "b": pytest.approx(2.0), "c": pytest.approx(2.0)}

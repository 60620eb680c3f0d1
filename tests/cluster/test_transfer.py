"""KV page transfer: real worker processes on one host read each other's pools through NIXL (UCX).

Each pool process owns a small hybrid ``KVCacheStorage`` (3 attention layers x (K, V) [32 pages, 4 slots,
2 heads, head_dim] fp32 with distinct values, plus one linear-attention layer whose state slots are not
transferred) and serves its ``KVTransferAgent`` over a pipe. The test process creates no NIXL agent.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from nebula_engine.cluster.runtime.transfer import (KVTransferAgent, PoolLayout, TransferError,
                                            check_compatible, decode_metadata, nixl_available, pool_layout)
from nebula_engine.kvcache.pool import KVCacheStorage
from nebula_engine.kvcache.spec import FullAttentionSpec, KVCacheGroupSpec, LinearStateSpec

NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM = 32, 4, 2, 8
CALL_TIMEOUT_S = 20.0
needs_nixl = pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")


def make_storage(head_dim: int, fill_base: float) -> KVCacheStorage:
    groups = [KVCacheGroupSpec((0, 1, 2), FullAttentionSpec(NUM_KV_HEADS, head_dim, head_dim)),
              KVCacheGroupSpec((0,), LinearStateSpec(conv_channels=4, conv_width=3, num_heads=1,
                                                     head_k_dim=2, head_v_dim=2))]
    storage = KVCacheStorage(groups, NUM_PAGES, PAGE_SIZE, "cpu", num_state_slots=2)
    offset = fill_base
    for layer in storage.layer_caches:
        for t in layer:  # every element of every tensor distinct (fp32 holds these integers exactly)
            t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) + offset)
            offset += t.numel()
    return storage


def pool_tensors(storage: KVCacheStorage) -> list[torch.Tensor]:
    return [t for layer in storage.layer_caches for t in layer]


def move_to_shared_memory(storage: KVCacheStorage) -> None:
    for t in pool_tensors(storage):
        t.share_memory_()


def serve_pool(conn, name: str, head_dim: int, fill_base: float) -> None:
    """Pool process: build the storage and agent, then run agent methods sent over ``conn``."""
    storage = make_storage(head_dim, fill_base)
    agent = KVTransferAgent(name, pool_tensors(storage))
    pool_commands = {
        # clones: pickling a tensor through a pipe moves its storage to shared memory, away from the
        # address NIXL registered
        "tensors": lambda: [t.clone() for t in pool_tensors(storage)],
        "share_memory": lambda: move_to_shared_memory(storage),
    }
    conn.send(agent.metadata())
    while True:
        method, args = conn.recv()
        if method == "exit":
            agent.close()
            return
        try:
            attribute = pool_commands.get(method) or getattr(agent, method)
            conn.send(("ok", attribute(*args) if callable(attribute) else attribute))
        except Exception as e:  # sent back so the test raises the same type with the same message
            conn.send((type(e).__name__, str(e)))


class PoolProcess:
    def __init__(self, ctx, name: str, head_dim: int = HEAD_DIM, fill_base: float = 0.0):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve_pool, args=(child, name, head_dim, fill_base), daemon=True)
        self.process.start()
        self.metadata: bytes | None = None

    def _recv(self):
        if not self.conn.poll(CALL_TIMEOUT_S):
            raise TimeoutError(f"pool process {self.name!r} gave no answer in {CALL_TIMEOUT_S} s")
        return self.conn.recv()

    def wait_ready(self) -> None:
        self.metadata = self._recv()

    def call(self, method: str, *args):
        self.conn.send((method, args))
        status, result = self._recv()
        if status == "ok":
            return result
        raise {"ValueError": ValueError, "TransferError": TransferError}.get(status, RuntimeError)(result)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("exit", ()))
            except OSError:
                pass
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


@pytest.fixture(scope="module")
def pools(request):
    """A and D: sources; B: the reader; C: a pool with a different head_dim. Stopped by pid at the end."""
    ctx = mp.get_context("spawn")
    procs: dict[str, PoolProcess] = {}
    request.addfinalizer(lambda: [p.stop() for p in procs.values()])
    for name, head_dim, fill_base in [("A", HEAD_DIM, 1_000.0), ("B", HEAD_DIM, -100_000.0),
                                      ("C", HEAD_DIM // 2, 0.0), ("D", HEAD_DIM, 500_000.0)]:
        procs[name] = PoolProcess(ctx, name, head_dim, fill_base)
    for p in procs.values():
        p.wait_ready()
    procs["B"].call("add_peer", "A", procs["A"].metadata)
    return procs


@needs_nixl
def test_agent_covers_attention_layers_only(pools):
    layout: PoolLayout = pools["B"].call("layout")
    assert layout.num_pages == NUM_PAGES and layout.mem_type == "DRAM"
    assert [t.page_shape for t in layout.tensors] == [(PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)] * 6
    assert pools["B"].call("peers") == ["A"]


@needs_nixl
def test_read_scattered_pages_copies_exactly_and_nothing_else(pools):
    remote = [0, 3, 4, 5, 17, 31, 9]
    local = [30, 1, 2, 12, 6, 0, 20]
    expected = pool_tensors(make_storage(HEAD_DIM, -100_000.0))
    for dst, src in zip(expected, pool_tensors(make_storage(HEAD_DIM, 1_000.0))):
        dst[local] = src[remote]

    moved = pools["B"].call("read_pages", "A", remote, local)

    assert moved == len(remote) * 6 * PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
    for got, want in zip(pools["B"].call("tensors"), expected, strict=True):
        assert torch.equal(got, want)


@needs_nixl
def test_a_holder_that_expects_no_reads_still_serves_one(pools):
    """``serve_reads(False)`` only slows the holder's progress thread: a read that comes anyway completes, exactly."""
    a, b = pools["A"], pools["B"]
    remote, local = [2, 8, 30], [10, 11, 25]
    expected = b.call("tensors")
    for dst, src in zip(expected, a.call("tensors")):
        dst[local] = src[remote]
    a.call("serve_reads", False)
    try:
        b.call("read_pages", "A", remote, local)
    finally:
        a.call("serve_reads", True)
    for got, want in zip(b.call("tensors"), expected, strict=True):
        assert torch.equal(got, want)


@needs_nixl
def test_incompatible_layout_is_rejected(pools):
    with pytest.raises(ValueError, match=r"pool tensor 0 pages differ.*\[4, 2, 4\].*\[4, 2, 8\]"):
        pools["B"].call("add_peer", "C", pools["C"].metadata)
    with pytest.raises(ValueError, match="metadata is of agent 'A', not 'X'"):
        pools["B"].call("add_peer", "X", pools["A"].metadata)
    assert pools["B"].call("peers") == ["A"]


@needs_nixl
def test_unknown_peer_raises_transfer_error(pools):
    with pytest.raises(TransferError, match="unknown peer 'nobody'"):
        pools["B"].call("read_pages", "nobody", [0], [0])


@needs_nixl
@pytest.mark.parametrize("remote, local, message", [
    ([0, 32], [3, 4], "remote .* page 32 out of range"),
    ([0, 1], [3, -1], "local page -1 out of range"),
    ([0, 1], [3], "2 remote pages but 1 local"),
    ([0, 1], [3, 3], "local pages repeat"),
])
def test_bad_page_ids_raise_before_any_transfer(pools, remote, local, message):
    before = pools["B"].call("tensors")
    with pytest.raises(ValueError, match=message):
        pools["B"].call("read_pages", "A", remote, local)
    # the valid leading pair (A's 0 -> our 3) must not have moved either
    for got, want in zip(pools["B"].call("tensors"), before, strict=True):
        assert torch.equal(got, want)


@needs_nixl
def test_dead_peer_raises_transfer_error_and_agent_stays_usable(pools):
    b, d = pools["B"], pools["D"]
    b.call("add_peer", "D", d.metadata)
    b.call("read_pages", "D", [7], [7])
    d.process.kill()
    d.process.join(5)

    with pytest.raises(TransferError, match="peer 'D'"):
        b.call("read_pages", "D", [1, 2], [1, 2], 3.0)

    b.call("remove_peer", "D")
    assert b.call("peers") == ["A"]
    b.call("read_pages", "A", [11], [11])
    assert torch.equal(b.call("tensors")[5][11], pool_tensors(make_storage(HEAD_DIM, 1_000.0))[5][11])


@needs_nixl
def test_moved_pool_memory_is_refused(pools):
    c = pools["C"]  # only its metadata is used elsewhere, so its pool may move
    c.call("share_memory")
    with pytest.raises(TransferError, match="pool tensor 0 moved"):
        c.call("read_pages", "A", [0], [0])


# ---- layout and metadata checks: no NIXL, no processes ----

def test_page_descriptors_point_at_each_page():
    tensors = pool_tensors(make_storage(HEAD_DIM, 0.0))
    layout = pool_layout("w", tensors)
    descs = layout.page_descs()
    assert descs.shape == (len(tensors) * NUM_PAGES, 3)
    for t_index in (0, 5):
        for page in (0, 13, NUM_PAGES - 1):
            addr, size, dev = descs[layout.desc_indices(np.array([page]))[t_index]]
            assert (addr, size, dev) == (tensors[t_index][page].data_ptr(), tensors[t_index][page].nbytes, 0)


def test_pool_layout_rejects_unusable_tensors():
    with pytest.raises(ValueError, match="contiguous"):
        pool_layout("w", [torch.zeros(8, 4).t()])
    with pytest.raises(ValueError, match="pool tensor 1 has 3 pages"):
        pool_layout("w", [torch.zeros(4, 2), torch.zeros(3, 2)])
    with pytest.raises(ValueError, match="at least one"):
        pool_layout("w", [])


def test_check_compatible_allows_other_page_counts_but_not_other_layer_counts():
    ours = pool_layout("a", [torch.zeros(4, 2), torch.zeros(4, 2)])
    check_compatible(ours, pool_layout("b", [torch.zeros(9, 2), torch.zeros(9, 2)]))
    with pytest.raises(ValueError, match="peer 'c' has 1 pool tensors"):
        check_compatible(ours, pool_layout("c", [torch.zeros(4, 2)]))
    with pytest.raises(ValueError, match="torch.float16"):
        check_compatible(ours, pool_layout("d", [torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.float16)]))


def test_garbage_metadata_is_a_clear_error():
    with pytest.raises(ValueError, match="not KV transfer agent metadata"):
        decode_metadata(b"\x93not metadata")

"""Random insert / match / lock / unlock / evict / demote / promote sequences on a tiny shared pool.

After every step: no page is leaked or double-freed (each ref count equals the holders the test can
name), locked entries are still cached, the eviction policy's rule held at every eviction, the
events replayed on an empty index reproduce the store's snapshot exactly, and (with tiers) every
device page holds exactly the contents of the entry that owns it, however often it moved.
"""

import shutil
import tempfile
from collections import Counter

import torch

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nebula_engine.kvcache.cache_store import CacheStore, CacheStoreConfig
from nebula_engine.kvcache.events import CacheIndex, CacheKind, EvictEvent, Tier
from nebula_engine.kvcache.eviction import CacheState
from nebula_engine.kvcache.pic_store import segment_key
from nebula_engine.kvcache.pool import OutOfPagesError
from nebula_engine.kvcache.tiers import TierConfig

PAGE_SIZE = 2
NUM_PAGES = 12
TOKENS = st.lists(st.integers(0, 1), min_size=PAGE_SIZE, max_size=5 * PAGE_SIZE)


def expected_kind(policy: str, p: float, state: CacheState) -> CacheKind | None:
    """Independent statement of each rule (soft-share is paper eq. 2)."""
    pc_ok, pic_ok = state.oldest_pc is not None, state.oldest_pic is not None
    if not (pc_ok and pic_ok):
        return CacheKind.PC if pc_ok else (CacheKind.PIC if pic_ok else None)
    if policy == "soft-share":
        over = state.pc_tokens > p * (state.pc_tokens + state.pic_tokens)
        return CacheKind.PC if over else CacheKind.PIC
    if policy == "unified-lru":
        return CacheKind.PC if state.oldest_pc < state.oldest_pic else CacheKind.PIC
    pc_fill = state.pc_tokens / max(p * state.capacity_tokens, 1e-9)
    pic_fill = state.pic_tokens / max((1 - p) * state.capacity_tokens, 1e-9)
    return CacheKind.PC if pc_fill >= pic_fill else CacheKind.PIC


class FakePageIO:
    """The "device": one row of token ids per page, so contents can be checked after every move."""

    def __init__(self):
        self.device = torch.full((NUM_PAGES, PAGE_SIZE), -1, dtype=torch.long)

    def read_pages(self, pages):
        return [self.device[pages].clone()]

    def write_pages(self, pages, data):
        self.device[pages] = data[0]

    def compute(self, pages, tokens):
        padded = list(tokens) + [-2] * (len(pages) * PAGE_SIZE - len(tokens))
        self.device[pages] = torch.tensor(padded, dtype=torch.long).view(len(pages), PAGE_SIZE)


class CacheStoreMachine(RuleBasedStateMachine):
    policy_name = "soft-share"
    tiers = None

    def __init__(self):
        super().__init__()
        self.io = FakePageIO()
        self.disk_dir = tempfile.mkdtemp(prefix="nebula-disk-")
        tiers = self.tiers and TierConfig(**{**self.tiers, "disk_path": self.disk_dir})
        self.store = CacheStore(NUM_PAGES, PAGE_SIZE, CacheStoreConfig(worker_id=3, eviction_policy=self.policy_name),
                                tiers, self.io)
        self.pool = self.store.pool
        self.segment_tokens = {}
        self.decisions: list[CacheKind] = []
        self._spy_on_policy()
        self.held_pc = []  # (locked node, pages this "request" holds a reference to)
        self.held_pic = []  # locked PIC entries
        self.replayed = CacheIndex(worker=3)
        self.evicted_kinds: list[CacheKind] = []

    def _spy_on_policy(self):
        policy, store = self.store.policy, self.store
        decide = policy.victim_kind

        def checked(state: CacheState):
            occupancy = store.occupancy()
            assert state.pc_tokens == occupancy[CacheKind.PC, Tier.DEVICE]
            assert state.pic_tokens == occupancy[CacheKind.PIC, Tier.DEVICE]
            kind = decide(state)
            assert kind == expected_kind(self.policy_name, policy.pc_share, state)
            if kind is not None:
                self.decisions.append(kind)
            return kind
        policy.victim_kind = checked

    def _allocate(self, n: int) -> list[int] | None:
        try:
            return self.pool.allocate(n)
        except OutOfPagesError:
            return None

    @rule(tokens=TOKENS, keep=st.booleans())
    def insert_prefix(self, tokens, keep):
        tokens = tokens[: len(tokens) // PAGE_SIZE * PAGE_SIZE]
        last, cached = self._match_promote_lock(tokens)
        new = self._allocate(len(tokens) // PAGE_SIZE - len(cached))
        self.store.radix.dec_lock_ref(last)  # insert_prefix hands back the whole path locked
        if new is None:
            self.pool.release(cached)
            return
        self.io.compute(new, tokens[len(cached) * PAGE_SIZE:])
        node = self.store.insert_prefix(self.store.radix.root, tokens, cached + new)
        self.held_pc.append((node, cached + new))
        self._check_quota(CacheKind.PC)
        if not keep:
            self.unlock_prefix(len(self.held_pc) - 1)

    def _check_quota(self, kind):
        state, policy = self.store.state(), self.store.policy
        if self.policy_name == "fixed-partition" and state.evictable(kind):
            share = policy.pc_share if kind is CacheKind.PC else 1 - policy.pc_share
            assert state.tokens(kind) <= share * state.capacity_tokens

    def _match_promote_lock(self, tokens):
        """What a request does at admission: device hit, then promotion from lower tiers, pinned."""
        match = self.store.radix.match_prefix(tokens)
        self.store.radix.inc_lock_ref(match.last_node)
        last, promoted = self.store.promote_prefix(match.last_node, tokens[len(match.pages) * PAGE_SIZE:])
        self.pool.share(match.pages + promoted)
        return last, match.pages + promoted

    @rule(tokens=TOKENS)
    def match_and_lock(self, tokens):
        self.held_pc.append(self._match_promote_lock(tokens))

    @precondition(lambda self: self.held_pc)
    @rule(index=st.integers(0, 100))
    def unlock_prefix(self, index):
        node, pages = self.held_pc.pop(index % len(self.held_pc))
        self.store.radix.dec_lock_ref(node)
        self.pool.release(pages)

    @rule(tokens=TOKENS, keep=st.booleans())
    def insert_segment(self, tokens, keep):
        key = segment_key("m", "b", tokens)
        self.segment_tokens[key] = tokens
        entry = self.store.lookup_segment(key, len(tokens))
        if entry is None:
            pages = self._allocate(-(-len(tokens) // PAGE_SIZE))
            if pages is None:
                return
            self.io.compute(pages, tokens)
            entry = self.store.insert_segment(key, len(tokens), pages, {"end_state": torch.tensor(tokens)})
            self._check_quota(CacheKind.PIC)
            self.pool.release(pages)  # the "request" is done with its own copy
        assert entry.state["end_state"].tolist() == tokens
        if keep:
            self.held_pic.append(entry)
        else:
            self.store.pic.unlock(entry)

    @precondition(lambda self: self.held_pic)
    @rule(index=st.integers(0, 100))
    def unlock_segment(self, index):
        self.store.pic.unlock(self.held_pic.pop(index % len(self.held_pic)))

    @rule(num_pages=st.integers(1, NUM_PAGES))
    def evict(self, num_pages):
        self.store.evict(num_pages)

    @rule(pc_share=st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]))
    def set_pc_share(self, pc_share):
        before = self.store.snapshot()
        self.store.set_pc_share(pc_share)
        assert self.store.snapshot() == before  # retargeting evicts nothing by itself

    @invariant()
    def pages_are_accounted_exactly(self):
        holders = Counter(node.page for node in self.store.radix.nodes())
        holders.update(p for entry in self.store.pic.entries() for p in entry.pages)
        holders.update(p for _, pages in self.held_pc for p in pages)
        assert all(self.pool.ref_cnt[p] == holders[p] for p in range(NUM_PAGES))
        assert sorted(self.pool._free) == [p for p in range(NUM_PAGES) if holders[p] == 0]
        self.store.check_integrity()

    @invariant()
    def device_pages_hold_their_entries_contents(self):
        for node in self.store.radix.nodes():
            assert self.io.device[node.page].tolist() == list(node.tokens)
        for entry in self.store.pic.entries():
            tokens = self.segment_tokens[entry.key]
            assert self.io.device[list(entry.pages)].flatten()[: len(tokens)].tolist() == tokens

    def teardown(self):
        self.store.flush()
        if self.store.tiers is not None:
            self.store.tiers.close()
        shutil.rmtree(self.disk_dir, ignore_errors=True)

    @invariant()
    def locked_entries_are_never_evicted(self):
        for node, pages in self.held_pc:
            path = []
            while not node.is_root:
                assert node.parent.children.get(node.key) is node
                path.append(node.page)
                node = node.parent
            assert path[::-1] == pages
        assert all(entry.key in self.store.pic for entry in self.held_pic)

    @invariant()
    def events_replay_to_the_snapshot_and_evictions_follow_the_policy(self):
        for event in self.store.drain_events():
            self.replayed.apply(event)
            source = event.tier if isinstance(event, EvictEvent) else getattr(event, "src", None)
            if source is Tier.DEVICE:  # dropped or demoted
                self.evicted_kinds.append(event.kind)
        assert self.replayed == self.store.snapshot()
        if self.policy_name != "fixed-partition":  # fixed-partition also evicts to hold its quota on insert
            assert self.evicted_kinds == self.decisions


class UnifiedLRUMachine(CacheStoreMachine):
    policy_name = "unified-lru"


class FixedPartitionMachine(CacheStoreMachine):
    policy_name = "fixed-partition"


class TieredMachine(CacheStoreMachine):
    tiers = dict(host_capacity_tokens=6, disk_capacity_tokens=8)


class DropWhenEvictedMachine(CacheStoreMachine):
    tiers = dict(host_capacity_tokens=6, disk_capacity_tokens=8, demote_on_evict=False)


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("machine", [CacheStoreMachine, UnifiedLRUMachine, FixedPartitionMachine, TieredMachine,
                                     DropWhenEvictedMachine], ids=lambda m: m.__name__)
def test_cache_store_state_machine(machine):
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()

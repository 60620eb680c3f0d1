"""Frozen configuration for the control plane and the simulator.

A :class:`ClusterProfile` holds the hardware numbers: the prefill-time model, the transfer links, KV
bytes per token, per-worker capacity of each tier and the combine cost of each PIC backend. It loads
from JSON: the shipped GPU profiles (``cluster/control/profiles/``) derive throughput from public specs, and
``nebula-engine profile`` writes one measured on the machine it runs on. Every number says where it
comes from in the profile's ``sources``. :class:`ClusterConfig` holds the policy knobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Sequence

from nebula_engine.cluster.control.messages import Tier

DEFAULT_PROFILE = "default"
LINKS = ("intra_node", "inter_node", "host_load", "disk_load")


@dataclass(frozen=True)
class PrefillTimeModel:
    """seconds = fixed_s + per_token_s * n + attention_s * n * (context + n / 2) for n new tokens after
    ``context`` cached ones. A batched forward pays ``fixed_s`` once for all its sequences."""

    fixed_s: float
    per_token_s: float
    attention_s: float

    def seconds(self, new_tokens: float, context_tokens: float = 0.0) -> float:
        if new_tokens <= 0:
            return 0.0
        return self.fixed_s + self.compute_seconds(new_tokens, context_tokens)

    def compute_seconds(self, new_tokens: float, context_tokens: float = 0.0) -> float:
        """The per-sequence part of a forward (no fixed cost)."""
        if new_tokens <= 0:
            return 0.0
        return self.per_token_s * new_tokens + self.attention_s * new_tokens * (context_tokens + new_tokens / 2)

    def batch_seconds(self, sequences: Sequence[tuple[float, float]]) -> float:
        """One forward over ``(new tokens, context tokens)`` of several sequences."""
        work = sum(self.compute_seconds(n, context) for n, context in sequences)
        return self.fixed_s + work if work > 0 else 0.0


@dataclass(frozen=True)
class TransferLink:
    bandwidth_bytes_per_s: float
    latency_s: float

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class ClusterProfile:
    """Hardware numbers. Workers ``0..N-1`` are prefill workers, placed ``gpus_per_node`` to a node;
    the decode worker takes the next slot. Links: same node -> ``intra_node``, else ``inter_node``;
    a copy on the host tier is read over ``host_load``, one on disk over ``disk_load``.

    ``combine_cost[backend]``: prefill tokens the combine spends per reused PIC token with that backend
    (1.0 = recomputing it: measured as the combine's time over a plain prefill of the same prompt). ``shared_compute``: the workers of a node share its ``node_cores`` processors (a
    local cluster on one CPU machine; prefill times are then single-core seconds), so a lone forward runs
    ``node_cores`` times faster and concurrent forwards share that speed. ``dispatch_s``: how long a cold
    segment scattered to a worker other than the home waits there beyond its prefill and its link's latency
    (the worker finishing what it is doing, the home's pin waiting for the segment); 0 in the paper's model.
    ``combine_queues``: a combine waits behind everything already queued at its home, as this project's engine
    runs a home's work in arrival order; False is the paper's model, where a combine whose KV is ready runs first
    (§7.2), so the home's queue counts only when the home computes a cold segment. ``lead_while_waiting``: a home
    whose combine waits for remote KV prefills the prompt's lead meanwhile (the regular tokens before its first PIC
    segment, past the prefix hit), as this project's peers do, so the planner counts the lead in the home's term
    instead of after the wait (``PlanningProblem.lead``); False is the paper's model, where it is part of C.
    ``expected_copies_wait``: a copy the view only expects (recorded on dispatch, not stored yet) is planned as read
    after the work its holder does first (``ClusterView.wait_tokens``, ``PlanningProblem.source_wait``), and read
    only when that wait costs less than recomputing it; False is the paper's optimistic accounting, where it counts
    as held (§5.1).
    """

    name: str
    prefill: PrefillTimeModel
    kv_bytes_per_token: int
    intra_node: TransferLink
    inter_node: TransferLink
    host_load: TransferLink
    disk_load: TransferLink
    gpus_per_node: int
    cache_capacity_tokens: int
    host_capacity_tokens: int
    max_batch_tokens: int
    pic_backend: str
    combine_cost: dict = field(hash=False)
    shared_compute: bool = False
    node_cores: float = 1.0
    dispatch_s: float = 0.0
    combine_queues: bool = False
    lead_while_waiting: bool = False
    expected_copies_wait: bool = False
    sources: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.pic_backend not in self.combine_cost:
            raise ValueError(f"profile {self.name!r}: no combine_cost for its pic_backend {self.pic_backend!r}")

    @property
    def combine_ratio(self) -> float:
        """Combine cost per reused PIC token of the backend this deployment runs."""
        return self.combine_cost[self.pic_backend]

    def node_of(self, worker: int) -> int:
        return worker // self.gpus_per_node

    def link(self, src: int, dst: int) -> TransferLink | None:
        """The link from ``src`` to ``dst``; None for the same worker (no transfer)."""
        if src == dst:
            return None
        return self.intra_node if self.node_of(src) == self.node_of(dst) else self.inter_node

    def transfer_seconds(self, src: int, dst: int, num_tokens: float) -> float:
        link = self.link(src, dst)
        if link is None or num_tokens <= 0:
            return 0.0
        return link.seconds(num_tokens * self.kv_bytes_per_token)

    def tier_link(self, tier: Tier) -> TransferLink | None:
        """How a copy on ``tier`` is read back into device memory; None for the device itself."""
        return {Tier.DEVICE: None, Tier.HOST: self.host_load, Tier.DISK: self.disk_load}[tier]

    def load_seconds(self, tier: Tier, num_tokens: float) -> float:
        link = self.tier_link(tier)
        return 0.0 if link is None or num_tokens <= 0 else link.seconds(num_tokens * self.kv_bytes_per_token)

    def relative_transfer_cost(self, src: int, dst: int) -> float:
        """d(src -> dst) of §7.2: per-token transfer time over per-token prefill time; 0 on itself."""
        link = self.link(src, dst)
        if link is None:
            return 0.0
        return self.kv_bytes_per_token / link.bandwidth_bytes_per_s / self.prefill.per_token_s

    def relative_transfer_latency(self, src: int, dst: int) -> float:
        """The link's fixed latency in prefill tokens (paid once per source, whatever it sends); 0 on itself."""
        link = self.link(src, dst)
        return 0.0 if link is None else link.latency_s / self.prefill.per_token_s

    def relative_dispatch(self, worker: int, home: int) -> float:
        """``dispatch_s`` in prefill tokens, paid by a worker once it computes for another home; 0 on itself."""
        return 0.0 if worker == home else self.dispatch_s / self.prefill.per_token_s

    def tier_cost(self, tier: Tier) -> float:
        """Per-token cost, in prefill tokens, of reading a copy on ``tier`` into device memory."""
        link = self.tier_link(tier)
        return 0.0 if link is None else self.kv_bytes_per_token / link.bandwidth_bytes_per_s / self.prefill.per_token_s

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["prefill"] = vars(self.prefill).copy()
        for name in LINKS:
            data[name] = vars(data[name]).copy()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ClusterProfile":
        optional = ("shared_compute", "node_cores", "dispatch_s", "combine_queues", "lead_while_waiting",
                    "expected_copies_wait", "sources")
        required = {f.name for f in fields(cls) if f.name not in optional}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"profile {data.get('name', '?')!r} lacks {', '.join(missing)}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"profile {data.get('name', '?')!r} has unknown fields {', '.join(unknown)}")
        links = {k: TransferLink(**data[k]) for k in LINKS}
        plain = {k: v for k, v in data.items() if k not in links and k != "prefill"}
        return cls(prefill=PrefillTimeModel(**data["prefill"]), **links, **plain)

    @classmethod
    def load(cls, path_or_name: str | Path = DEFAULT_PROFILE) -> "ClusterProfile":
        """Load a profile JSON file, or a profile shipped in ``cluster/control/profiles/`` by name."""
        path = Path(path_or_name)
        if path.suffix == ".json":
            if not path.is_file():
                raise FileNotFoundError(f"no profile file {path}")
            text = path.read_text()
        else:
            shipped = resources.files("nebula_engine.cluster.control") / "profiles" / f"{path_or_name}.json"
            if not shipped.is_file():
                raise FileNotFoundError(f"no profile file or shipped profile named {path_or_name!r}")
            text = shipped.read_text()
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class ViewConfig:
    """How the cluster view learns about cache state (§5).

    ``record_on_dispatch``: add expected holders when a plan is dispatched (optimistic accounting).
    ``apply_cache_events``: apply worker store/evict events. ``unconfirmed_ttl_s``: lifetime of an
    optimistic record no store event confirmed (None = never expires). ``modelled_capacity_tokens``:
    when set, the view runs its own LRU model of each worker's capacity (the optimistic strawman).
    """

    record_on_dispatch: bool = True
    apply_cache_events: bool = True
    unconfirmed_ttl_s: float | None = 5.0
    modelled_capacity_tokens: int | None = None


@dataclass(frozen=True)
class CacheManagerConfig:
    initial_pc_share: float = 0.5  # §6.2: p starts at 0.5
    update_window: int = 16  # U: requests between updates of p (§6.2 default)
    step: float = 0.01  # the most p moves per update (§6.2: one percentage point)
    ghost_capacity: int = 1 << 20  # ids kept in each B queue


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill_workers: int = 7
    profile: ClusterProfile = field(default_factory=ClusterProfile.load)
    view: ViewConfig = ViewConfig()
    cache_manager: CacheManagerConfig = CacheManagerConfig()
    event_delay_s: float = 0.005  # worker -> router event delivery
    seed: int = 0

    def with_profile(self, **changes) -> "ClusterConfig":
        return replace(self, profile=replace(self.profile, **changes))

    @property
    def decode_worker(self) -> int:
        return self.num_prefill_workers

"""Frozen configuration for the control plane and the simulator.

A :class:`ClusterProfile` holds the measured (or derived) hardware numbers: the prefill-time model,
the transfer links, KV bytes per token and per-worker cache capacity. It loads from JSON so it can
be calibrated from real engine runs. :class:`ClusterConfig` holds the policy knobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path

DEFAULT_PROFILE = "default"


@dataclass(frozen=True)
class PrefillTimeModel:
    """seconds = fixed_s + per_token_s * n + attention_s * n * (context + n) / 2 for n new tokens."""

    fixed_s: float
    per_token_s: float
    attention_s: float

    def seconds(self, new_tokens: float, context_tokens: float = 0.0) -> float:
        if new_tokens <= 0:
            return 0.0
        attention = self.attention_s * new_tokens * (context_tokens + new_tokens / 2)
        return self.fixed_s + self.per_token_s * new_tokens + attention


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
    reading from host memory adds ``host_load`` (the slow tier)."""

    name: str
    prefill: PrefillTimeModel
    kv_bytes_per_token: int
    intra_node: TransferLink
    inter_node: TransferLink
    host_load: TransferLink
    gpus_per_node: int
    cache_capacity_tokens: int
    pic_recompute_ratio: float
    sources: dict = field(default_factory=dict, compare=False, hash=False)

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

    def relative_transfer_cost(self, src: int, dst: int) -> float:
        """d(src -> dst) of §7.2: per-token transfer time over per-token prefill time; 0 on itself."""
        link = self.link(src, dst)
        if link is None:
            return 0.0
        return self.kv_bytes_per_token / link.bandwidth_bytes_per_s / self.prefill.per_token_s

    def host_load_cost(self) -> float:
        """Per-token cost, in prefill tokens, of reading a segment from the host tier."""
        return self.kv_bytes_per_token / self.host_load.bandwidth_bytes_per_s / self.prefill.per_token_s

    @classmethod
    def from_dict(cls, data: dict) -> "ClusterProfile":
        links = {k: TransferLink(**data[k]) for k in ("intra_node", "inter_node", "host_load")}
        plain = {f.name: data[f.name] for f in fields(cls)
                 if f.name in data and f.name not in links and f.name != "prefill"}
        return cls(prefill=PrefillTimeModel(**data["prefill"]), **links, **plain)

    @classmethod
    def load(cls, path_or_name: str | Path = DEFAULT_PROFILE) -> "ClusterProfile":
        """Load a profile JSON file, or a profile shipped in ``cluster/profiles/`` by name."""
        path = Path(path_or_name)
        if path.suffix == ".json" and path.exists():
            text = path.read_text()
        else:
            shipped = resources.files("nebula_engine.cluster") / "profiles" / f"{path_or_name}.json"
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
    initial_pc_share: float = 0.5
    update_window: int = 16  # U: requests between updates of p
    step: float = 0.01  # the most p moves per update
    ghost_capacity: int = 1 << 20  # ids kept in each B queue


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill_workers: int = 7
    profile: ClusterProfile = field(default_factory=ClusterProfile.load)
    view: ViewConfig = ViewConfig()
    cache_manager: CacheManagerConfig = CacheManagerConfig()
    event_delay_s: float = 0.005  # worker -> router event delivery
    eviction: str = "soft-share"  # soft-share | unified-lru | fixed-partition
    seed: int = 0

    def with_profile(self, **changes) -> "ClusterConfig":
        return replace(self, profile=replace(self.profile, **changes))

    @property
    def decode_worker(self) -> int:
        return self.num_prefill_workers

"""Self-tuning PC/PIC capacity shares of §6 (eq. 1), from cluster-wide ghost hits, per storage tier.

For each tier, T_PC / T_PIC hold ids of entries present on that tier somewhere in the cluster view and
B_PC / B_PIC ids that were present there and are no longer (ghosts): a demotion from the device to the
host makes a device ghost and a host entry. A request's tokens are attributed per tier, prefix-first,
each token to at most one category: live prefix (T_PC), ghost prefix (B_PC -> G_PC), then for PIC
segments past the prefix, live PIC (T_PIC) or ghost PIC (B_PIC -> G_PIC). Every U requests each tier
updates ``p <- clip(p + step * (G_PC - G_PIC) / (G_PC + G_PIC))`` from its own window counters (§6.2:
"the four queues separately for each storage tier ... using that tier's reuse feedback").
"""

from __future__ import annotations

from collections import OrderedDict

from nebula_engine.cluster.control.config import CacheManagerConfig
from nebula_engine.cluster.control.messages import CacheKind, Tier
from nebula_engine.cluster.control.request_keys import RequestKeys


class TierFeedback:
    """The four queues, the window's ghost counters and the PC share p of one storage tier."""

    def __init__(self, config: CacheManagerConfig):
        self.config = config
        self.pc_share = config.initial_pc_share
        self.live = {kind: set() for kind in CacheKind}
        self.ghosts = {kind: OrderedDict() for kind in CacheKind}
        self.ghost_tokens = {kind: 0 for kind in CacheKind}  # G_PC, G_PIC of the current window
        self.history: list[float] = [self.pc_share]  # p after each update (Fig. 16)

    def on_presence(self, kind: CacheKind, key: str, present: bool) -> None:
        if present:
            self.live[kind].add(key)
            self.ghosts[kind].pop(key, None)
            return
        self.live[kind].discard(key)
        ghosts = self.ghosts[kind]
        ghosts[key] = None
        ghosts.move_to_end(key)
        if len(ghosts) > self.config.ghost_capacity:
            ghosts.popitem(last=False)

    def attribute(self, keys: RequestKeys) -> dict[str, int]:
        """Per-token feedback categories of one request (no side effects)."""
        counts = {"pc_live": 0, "pc_ghost": 0, "pic_live": 0, "pic_ghost": 0}
        depth = 0
        for kind_set, category in ((self.live[CacheKind.PC], "pc_live"),
                                   (self.ghosts[CacheKind.PC], "pc_ghost")):
            while depth < len(keys.pc_keys) and keys.pc_keys[depth] in kind_set:
                counts[category] += keys.tokens[depth]
                depth += 1
        for index in keys.pic_indices:
            if index < depth:
                continue  # already counted by the prefix: one category per token
            cid, tokens = keys.content_ids[index], keys.tokens[index]
            if cid in self.live[CacheKind.PIC]:
                counts["pic_live"] += tokens
            elif cid in self.ghosts[CacheKind.PIC]:
                counts["pic_ghost"] += tokens
        return counts

    def observe(self, keys: RequestKeys) -> None:
        counts = self.attribute(keys)
        self.ghost_tokens[CacheKind.PC] += counts["pc_ghost"]
        self.ghost_tokens[CacheKind.PIC] += counts["pic_ghost"]

    def update(self) -> float:
        g_pc, g_pic = self.ghost_tokens[CacheKind.PC], self.ghost_tokens[CacheKind.PIC]
        direction = (g_pc - g_pic) / (g_pc + g_pic) if g_pc + g_pic > 0 else 0.0
        self.pc_share = min(1.0, max(0.0, self.pc_share + self.config.step * direction))
        self.ghost_tokens = {kind: 0 for kind in CacheKind}
        self.history.append(self.pc_share)
        return self.pc_share


class CacheManager:
    """Router-side ghost accounting over every tier; ``pc_share`` is the device tier's p."""

    def __init__(self, config: CacheManagerConfig = CacheManagerConfig()):
        self.config = config
        self.tiers = {tier: TierFeedback(config) for tier in Tier}
        self._requests_in_window = 0

    @property
    def pc_share(self) -> float:
        return self.tiers[Tier.DEVICE].pc_share

    @property
    def shares(self) -> dict[Tier, float]:
        return {tier: feedback.pc_share for tier, feedback in self.tiers.items()}

    @property
    def history(self) -> list[float]:
        """The device tier's p after each update (Fig. 16)."""
        return self.tiers[Tier.DEVICE].history

    def on_presence(self, kind: CacheKind, key: str, tier: Tier, present: bool, num_tokens: int) -> None:
        """View listener: ``key`` gained its first holder on ``tier`` (T, leaves B) or lost its last (T -> B)."""
        self.tiers[tier].on_presence(kind, key, present)

    def attribute(self, keys: RequestKeys, tier: Tier = Tier.DEVICE) -> dict[str, int]:
        return self.tiers[tier].attribute(keys)

    def observe(self, keys: RequestKeys) -> dict[Tier, float] | None:
        """Account one request; returns every tier's new p when this request closes a window, else None."""
        for feedback in self.tiers.values():
            feedback.observe(keys)
        self._requests_in_window += 1
        if self._requests_in_window < self.config.update_window:
            return None
        self._requests_in_window = 0
        return {tier: feedback.update() for tier, feedback in self.tiers.items()}

"""Cluster control plane (pure logic) and its discrete-event simulator.

messages (events, plans) -> view (§5) -> cache_manager (§6) -> planner / schedulers (§7) -> policies
-> control_plane (what the router runs) -> sim (the same control plane over simulated workers: worker_cache,
sim_hardware, sim_report; loads expresses arrival rates against a simulated cluster's capacity).
"""

from nebula_engine.cluster.config import ClusterConfig, ClusterProfile, ViewConfig
from nebula_engine.cluster.control_plane import ControlPlane, Decision
from nebula_engine.cluster.sim import SimulationConfig, simulate

__all__ = ["ClusterConfig", "ClusterProfile", "ControlPlane", "Decision", "SimulationConfig", "ViewConfig",
           "simulate"]

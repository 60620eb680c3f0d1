"""The cluster's pure control plane (paper §5–§7), shared by the real router and the simulator.

``messages`` (cache events, plans) → ``view`` (§5, what each worker holds) → ``cache_manager`` (§6,
placement and eviction advice) → ``planner`` / ``schedulers`` (§7, where each segment is computed or read
from) → ``policies`` (the compared systems) → ``control_plane`` (one decision per request). ``config``
holds the frozen configs and the shipped GPU profiles; ``request_keys`` names a request's cache entries.
Everything here is deterministic, in-memory logic: it imports nothing from the runtime, the simulator,
the engine or ``workloads``.
"""

"""Cluster mode: many engines sharing one position-independent KV cache (paper §4–§7).

Three sub-packages, each importable on its own:

- ``control``: the pure control plane the router and the simulator share. Cache events and plans
  (``messages``) feed the cluster view (§5), the cache manager (§6), the planner and schedulers (§7) and
  the policies; ``control_plane`` is what a router runs per request. No I/O, no threads, no engine.
- ``sim``: a discrete-event simulator that runs that same control plane over modelled workers, links and
  caches (``worker_cache``, ``hardware``), with arrival rates expressed against simulated capacity.
- ``runtime``: the real cluster. Peers (``peer``) with a ZMQ transport, NIXL transfers, Raft election,
  the router, workers that drive an engine through its two ports (``engine.kv_port``, ``engine.request_port``),
  and the OpenAI front end.

The dependency rule (tested in ``tests/test_dependency_rule.py``): ``sim`` and ``runtime`` import
``control``; ``control`` imports neither, nor ``workloads``, the engine or the server; ``sim`` and ``runtime``
never import each other. ``runtime`` imports of the engine only those ports and a short list of its plain data
types, and no attribute chain in it reaches past a port into the engine's internals (tested there too).
"""

"""Discrete-event simulator of a cluster: the control plane of ``cluster.control`` over modelled workers.

``simulator`` replays a workload trace; ``worker_cache`` models each worker's tiered KV cache,
``hardware`` its processors and links, ``report`` the latency and hit-rate summary; ``loads`` expresses
arrival rates against a simulated cluster's capacity. ``nebula-engine simulate`` is ``cli/simulate.py``.
"""

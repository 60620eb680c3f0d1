"""The real cluster: processes that serve requests with engines sharing a PIC cache.

``spec`` and ``launcher`` describe and start a cluster; ``peer`` is each process's composition root. Peers
talk over an authenticated ZMQ ``transport`` (``auth``, ``wire`` messages) and move KV pages with
``transfer`` (NIXL); ``election`` picks the router by Raft and ``liveness`` tracks peers. The ``router``
runs the control plane; a ``worker`` (its parts: ``prefill_tasks``, ``remote_reads``, ``pin_server``, ``handoff``,
``cache_reporting``, ``in_flight``, ``worker_codec``) drives its engine only through ``engine.cluster_port``; the
``frontend`` serves the OpenAI API and forwards requests to workers. Beside it, a peer serves ``metrics``
(Prometheus) and ``status`` (``GET /cluster``), and plans with ``cost_profile`` (its engine's measured costs).
"""

"""The real cluster: processes that serve requests with engines sharing a PIC cache.

``spec`` and ``launcher`` describe and start a cluster; ``peer`` is each process's composition root. Peers
talk over an authenticated ZMQ ``transport`` (``auth``, ``wire`` messages) and move KV pages with
``transfer`` (NIXL); ``election`` picks the router by Raft and ``liveness`` tracks peers. The ``router``
runs the control plane; a ``worker`` (its parts: ``prefill_tasks``, ``remote_reads``, ``pin_server``, ``handoff``,
``cache_reporting``, ``in_flight``, ``worker_codec``) and the ``frontend`` (which serves the OpenAI API and
forwards requests to workers) drive their engine only through its two ports, ``engine.kv_port`` and
``engine.request_port``, which ``peer`` builds once. Beside them, a peer serves ``metrics`` (Prometheus) and
``status`` (``GET /cluster``), and plans with ``cost_profile`` (its engine's measured costs).
"""

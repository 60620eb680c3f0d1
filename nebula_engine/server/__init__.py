"""OpenAI-compatible HTTP API (``api.build_app``) over an ``EngineClient``, with Prometheus metrics.

``api`` routes and error handling; ``protocol`` the wire format; ``inputs`` request -> engine prompt and
sampling params; ``responses`` engine outputs -> bodies and stream events; ``metrics`` the Prometheus
registry; ``engine_client`` the interface a local engine or the cluster front end implements; ``guards``
the API key and request-size checks in front of it (``limits`` their constants); ``commands`` the ``serve``
command.
"""

"""OpenAI-compatible HTTP API (``api.build_app``) over an ``EngineClient``, with Prometheus metrics.

``api`` routes and error handling; ``protocol`` the wire format; ``inputs`` request -> engine prompt and
sampling params (``chat_messages`` messages and tools -> what the chat template reads); ``responses`` engine
outputs -> bodies and stream events (``logprobs`` OpenAI's logprob shapes, ``tool_parsers`` tool calls in the
output per model family, ``tool_streaming`` their stream deltas); ``tokenize`` vLLM's ``/tokenize`` and
``/detokenize``; ``metrics`` the Prometheus
registry; ``engine_client`` the interface a local engine or the cluster front end implements; ``guards``
the API key and request-size checks in front of it (``limits`` their constants). ``nebula-engine serve`` is
``cli/serve.py``.
"""

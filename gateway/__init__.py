"""The tandem gateway: the public face of a tandem stack.

It tokenizes requests (applying chat templates), drives one target session per request through
the draft service's ``Speculate`` or the target's ``Generate``, detokenizes incrementally, applies
stop strings and token budgets, and serves the result over an OpenAI-compatible HTTP API and the
``tandem.v1.GatewayService`` gRPC API. Entry points: :func:`gateway.main.run` (blocking, for the
CLI) and :func:`gateway.main.start_gateway` (in-process, for tests).
"""

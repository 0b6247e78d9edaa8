"""The data plane: the ASGI app, the attempt loop, upstream I/O, relay, fleet state, probes, metrics, wiring.

Entry points: `build.build_balancer(settings, replicas)` and `serve.run` (`ramjet serve`).
"""

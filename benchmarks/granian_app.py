"""The balancer's app served by granian (an HTTP server in Rust), for `proxy_overhead.py --granian`: measurement only.

`granian --interface asgi --loop uvloop granian_app:app`, with the RJ_* settings in the environment: the
balancer is built as `ramjet serve` builds it, and started and stopped by the ASGI lifespan (BalancerApp's).
What `ramjet serve` puts around the app is not here: its hardened HTTP protocol (edge/protocol.py: the
connection, header and body limits and timeouts, docs/security.md), the operator and metrics listeners,
and the drain on SIGTERM. So this measures what the HTTP server costs, not a way to run the balancer.
"""

from __future__ import annotations

import asyncio

from ramjet.balancer.cluster.topology import build_replicas
from ramjet.balancer.edge.app import BalancerApp
from ramjet.balancer.runtime.build import build_balancer
from ramjet.balancer.server.serve import setup_logging
from ramjet.config import load_settings

_settings = load_settings()
setup_logging(_settings.log_level)
app = BalancerApp(build_balancer(_settings, asyncio.run(build_replicas(_settings))))

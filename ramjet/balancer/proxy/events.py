"""What happens to each attempt of a request, told to the parts that learn from it.

The attempt loop (forward.py) only reserves, opens and relays; around those steps it
tells its listeners what happened, in this order for one attempt on replica i:
`sent`, then `failed` (no first byte: the reason) or `first_byte` (its status) and,
once the answer is over, `relayed` (the Outcome then holds its result and usage).
The listeners below are the balancer's own: the fleet's fencing evidence, the router
learning what each replica holds, and precise mode's trust in each engine's reports.
"""

from __future__ import annotations

import time

from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.precise.mode import PreciseMode
from ramjet.balancer.proxy.outcome import Outcome
from ramjet.routing.router import Router

STRIKES = frozenset({"http_5xx", "first_byte_timeout", "fenced"})  # failures that count against a replica


def ok(status: int) -> bool:
    return 200 <= status < 300


class AttemptListener:
    """Told of every attempt; each method does nothing unless a listener cares."""

    def sent(self, o: Outcome, i: int) -> None:
        pass

    def failed(self, o: Outcome, i: int, reason: str) -> None:
        """No first byte from replica i: an upstream failure, a fence, or the client left (`client_left`)."""

    def first_byte(self, o: Outcome, i: int, status: int) -> None:
        pass

    def relayed(self, o: Outcome, i: int) -> None:
        pass


class Listeners(AttemptListener):
    """Several listeners as one, told in the order given."""

    def __init__(self, listeners: list[AttemptListener]):
        self.listeners = listeners

    def sent(self, o: Outcome, i: int) -> None:
        for x in self.listeners:
            x.sent(o, i)

    def failed(self, o: Outcome, i: int, reason: str) -> None:
        for x in self.listeners:
            x.failed(o, i, reason)

    def first_byte(self, o: Outcome, i: int, status: int) -> None:
        for x in self.listeners:
            x.first_byte(o, i, status)

    def relayed(self, o: Outcome, i: int) -> None:
        for x in self.listeners:
            x.relayed(o, i)


class Fencing(AttemptListener):
    """Evidence from real requests for the Fleet: failures are strikes (a refusal downs the engine),
    answers show the rank alive (cluster/fleet.py)."""

    def __init__(self, fleet: Fleet, engines: list[str]):
        self.fleet, self.engines = fleet, engines

    def failed(self, o: Outcome, i: int, reason: str) -> None:
        if reason == "refused":
            self.fleet.engine_refused(self.engines[i])
        elif reason in STRIKES:
            self.fleet.request_failed(i, o.request_id, reason)

    def first_byte(self, o: Outcome, i: int, status: int) -> None:
        if ok(status):
            self.fleet.progressed(i)
            self.fleet.request_succeeded(i)

    def relayed(self, o: Outcome, i: int) -> None:
        if o.result == "upstream_died":
            self.fleet.request_failed(i, o.request_id, "midstream")
        elif o.result == "ok" and ok(o.status):
            self.fleet.progressed(i)


class Learning(AttemptListener):
    """A 2xx first byte: the replica now holds the request's prefix (the router's index, and its gauge).
    Until then the request is in flight there (Router.sent, Router.settled)."""

    def __init__(self, router: Router, metrics: Metrics, labels: list[tuple[str, str, str]]):
        self.router = router
        self.gauges = [metrics.for_replica(x).index_blocks for x in labels]

    def sent(self, o: Outcome, i: int) -> None:
        self.router.sent(i, o.choice.decision)

    def failed(self, o: Outcome, i: int, reason: str) -> None:
        self.router.settled(o.choice.decision)

    def first_byte(self, o: Outcome, i: int, status: int) -> None:
        self.router.settled(o.choice.decision)
        if ok(status):
            self.router.answered(i, o.choice.decision, time.monotonic())
            self.gauges[i].set(self.router.index.size(i))

    def forget(self, i: int) -> None:
        """Replica i's cache is gone: so is what the router thought it held (a Fleet cache-loss subscriber)."""
        self.router.forget(i)
        self.gauges[i].set(0)


class PreciseTrust(AttemptListener):
    """Precise mode follows each routed request: its blocks bound what the replica may hold while it runs,
    count as held once computed, and the engine's reported cached tokens check the prediction."""

    def __init__(self, precise: PreciseMode):
        self.precise = precise

    def sent(self, o: Outcome, i: int) -> None:
        if o.choice.match is not None:
            self.precise.sent(i, o.choice.match)

    def failed(self, o: Outcome, i: int, reason: str) -> None:
        if o.choice.match is not None:
            self.precise.failed(i, o.choice.match)

    def first_byte(self, o: Outcome, i: int, status: int) -> None:
        if o.choice.match is not None:
            (self.precise.computed if ok(status) else self.precise.failed)(i, o.choice.match)

    def relayed(self, o: Outcome, i: int) -> None:
        m, d = o.choice.match, o.choice.decision
        if m is None or not m.known[i] or o.usage is None:
            return
        fp = d.fingerprint
        approximate = round(fp.covered_bytes(d.overlaps[i]) / max(fp.prompt_bytes, 1) * m.whole[0])
        self.precise.observe(i, m, approximate, o.usage.cached_tokens, o.usage.prompt_tokens)

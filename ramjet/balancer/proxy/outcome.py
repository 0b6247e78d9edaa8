"""One record per request, written in one place: metrics, the routing journal and the log line.

The forwarder fills an `Outcome` as the request goes (the decision, every
attempt, the answer, usage) and hands it to `Recorder.finish` exactly once,
whatever the ending: answered, failed over and out, rejected, or cancelled.
The dashboard's history (samples.py) is handed the same record, to fold in once a second.
Nothing here holds prompt text, URLs or keys.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from itertools import compress

import orjson

from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.proxy.decide import Choice
from ramjet.balancer.proxy.journal import Journal
from ramjet.balancer.proxy.samples import Samples
from ramjet.usage import Usage

log = logging.getLogger("ramjet.requests")


@dataclass(slots=True)
class Outcome:
    route: str
    request_id: str = ""                                # X-Ramjet-Request-Id, in the log line and journal
    t0: float = field(default_factory=time.monotonic)  # arrival, monotonic
    ts: float = field(default_factory=time.time)       # arrival, wall clock
    choice: Choice | None = None           # how it was routed (decide.py)
    attempts: list[dict] = field(default_factory=list)
    replica: int | None = None             # the replica that answered
    status: int | None = None              # what the client got
    result: str = "failed"                 # ok | failed | rejected | upstream_died | client_disconnected | error
    failure: str | None = None             # the last failed attempt's reason
    ttfb: float | None = None
    usage: Usage | None = None
    waited: float | None = None            # seconds held by overload admission (admission.py); None: not held

    def failed_attempt(self, replica: int, reason: str) -> None:
        self.attempts.append({"upstream": replica, "failed": reason})
        self.failure = reason

    def answered(self, replica: int, status: int) -> None:
        self.attempts.append({"upstream": replica, "status": status})
        self.replica = replica

    def affinity_hit(self) -> bool | None:
        """Did the replica that answered 2xx hold the longest overlap of those routable when it was decided?
        None when nobody held any of it, or it was not answered 2xx."""
        if self.choice is None or self.replica is None or not 200 <= self.attempts[-1].get("status", 0) < 300:
            return None
        overlaps = self.choice.decision.overlaps
        best = max(compress(overlaps, self.choice.routable), default=0)
        mine = overlaps[self.replica]
        if mine > 0 and mine >= best:
            return True
        return False if best > 0 else None


class Recorder:
    def __init__(self, metrics: Metrics, replicas: list[Replica], journal: Journal | None = None,
                 samples: Samples | None = None):
        self.metrics = metrics
        self.samples = samples if samples is not None else Samples(len(replicas))  # the dashboard's history
        self.replicas = replicas
        self.replica_metrics = [metrics.for_replica(r.labels) for r in replicas]
        self.ordinals = [str(r.ordinal) for r in replicas]
        self.journal = journal
        self._children: dict[tuple, object] = {}

    def finish(self, o: Outcome) -> None:
        duration = time.monotonic() - o.t0
        self._metrics(o, duration)
        self.samples.record(o)  # kept for the next second's sample: nothing computed here (samples.py)
        if self.journal and o.choice is not None:
            self.journal.write(self._journal_record(o, duration))
        if log.isEnabledFor(logging.INFO):
            log.info("%s", orjson.dumps(self._log_fields(o, duration)).decode())

    def _child(self, metric, *labels: str):
        """A labelled child, looked up once: prometheus_client locks and hashes on every .labels() call."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def _metrics(self, o: Outcome, duration: float) -> None:
        m, child = self.metrics, self._child
        if o.choice is not None:
            reason = o.choice.decision.ranking.reason
            m.routing_seconds.observe(o.choice.seconds)
            child(m.decisions, reason).inc()
            if reason == "fail_open":
                m.fail_open.inc()
            if (use := o.choice.decision.hint_use) is not None:
                child(m.session_hints, use).inc()
        for a in o.attempts:
            if "failed" in a:
                child(m.failovers, a["failed"]).inc()
        hit = o.affinity_hit()
        if hit is True:
            m.affinity_hits.inc()
        elif hit is False:
            m.affinity_misses.inc()
        if o.ttfb is not None:
            child(m.ttfb, o.route).observe(o.ttfb)
        if o.replica is not None:
            child(m.duration, o.route).observe(duration)
        upstream = "" if o.replica is None else self.ordinals[o.replica]
        child(m.requests, o.route, str(o.status), upstream).inc()
        if o.usage is not None and o.replica is not None:
            u = o.usage
            m.observe_usage(self.replica_metrics[o.replica], u.prompt_tokens, u.cached_tokens, u.completion_tokens)

    def _journal_record(self, o: Outcome, duration: float) -> dict:
        """One journal line (docs/replay.md): counts, the chain of block hashes and block sizes, the
        conversation key and tie-break key, loads, choice, timings and usage; never prompt text."""
        c = o.choice
        d, fp = c.decision, c.decision.fingerprint
        record = {"ts": round(o.ts, 6), "id": o.request_id, "route": o.route, "blocks": len(fp.blocks),
                  "prompt_bytes": fp.prompt_bytes, "chain": [f"{h:016x}" for h in fp.blocks],
                  "sizes": [b - a for a, b in zip([0, *fp.ends], fp.ends)],
                  "session": f"{self.journal.sessions.key(fp.settled_blocks):016x}",
                  "tiebreak": f"{fp.blocks[-1] if fp.blocks else 0:016x}",
                  "overlaps": d.overlaps, "scores": d.ranking.scores,
                  "loads": c.loads, "serving": c.routable, "reason": d.ranking.reason, "policy": d.policy,
                  "precise": [s is not None for s in c.match.shares] if c.match else None,
                  "attempts": o.attempts}
        if fp.settled >= 0:  # a growing text: how many leading blocks its next turn repeats (fingerprint.py)
            record["settled"] = fp.settled
        if d.hint:  # the session key's keyed hash (routing/hints.py), never the key
            record["hint"] = f"{d.hint:016x}"
        if o.replica is not None:
            record["choice"] = o.replica
        if o.waited is not None:
            record["waited_ms"] = round(o.waited * 1000, 3)
        record.update(outcome=o.result, status=o.status,
                      ttfb_ms=round(o.ttfb * 1000, 3) if o.ttfb is not None else None,
                      duration_ms=round(duration * 1000, 3),
                      usage=o.usage.as_dict() if o.usage else None)
        return record

    def _log_fields(self, o: Outcome, duration: float) -> dict:
        replica = self.replicas[o.replica] if o.replica is not None else None
        fields = {"id": o.request_id, "route": o.route, "upstream": replica.ordinal if replica else None,
                  "rank": replica.dp_rank if replica else None, "status": o.status, "outcome": o.result,
                  "attempts": len(o.attempts), "ttfb_ms": round(o.ttfb * 1000, 1) if o.ttfb is not None else None,
                  "duration_ms": round(duration * 1000, 1)}
        if o.waited is not None:
            fields["waited_ms"] = round(o.waited * 1000, 1)
        if o.usage:
            fields.update(o.usage.as_dict())
        return fields

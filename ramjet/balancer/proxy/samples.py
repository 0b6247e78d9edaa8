"""The dashboard's short history: one sample a second in a bounded ring, from what the requests ended with.

`Recorder.finish` (outcome.py) hands every finished request to `record`, which appends it to a
bounded list and computes nothing: that is the whole per-request cost, viewer or not. Once a
second `tick` (runtime/build.py) folds the requests of that second into a `Sample` (requests,
errors, failovers, prompt and cached tokens, and over the last `window` samples the cache ratio
and TTFT percentiles), and into each replica's figures (requests and tokens since start and over
the ring, conversations it hosts); the fleet's views add what is in flight and the fences of the
second. The last `recent` requests are kept whole, so the operator API can show how each one was
decided (edge/dashboard.py).

Pure: the caller passes the time and the fleet's views; nothing here reads a clock or does I/O.
Memory is bounded: `history` samples of a dozen numbers and a sparse TTFT histogram, `recent`
requests (their decisions: block hashes, overlaps and scores, never prompt text), at most
`sessions` conversation keys, and at most `pending` requests between two ticks (beyond that a
second's requests are counted, not looked at).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from ramjet.balancer.cluster.replica import ReplicaView
from ramjet.balancer.proxy.decide import Choice
from ramjet.routing.sessions import SessionKeys
from ramjet.usage import Usage

HISTORY = 300          # samples kept: five minutes at one a second
WINDOW = 60            # samples behind each sample's cache ratio and TTFT percentiles
RECENT = 100           # requests kept whole (their decisions), newest last
PENDING = 8192         # requests looked at between two ticks; more are counted only
SESSIONS = 16384       # conversations remembered
SESSION_IDLE_S = 600.0  # a conversation counts on its replica this long after its last answered turn
TTFT_BASE_S, TTFT_RATIO, TTFT_BUCKETS = 0.001, 1.2, 80  # log buckets from 1 ms: within 10% up to half an hour
FAILED = frozenset({"failed", "upstream_died", "error"})  # endings counted as errors (not a client leaving)


class Finished(Protocol):
    """What `record` and `tick` read of a finished request (outcome.py's Outcome)."""

    request_id: str
    route: str
    ts: float
    choice: Choice | None
    attempts: list[dict]
    replica: int | None
    status: int | None
    result: str
    ttfb: float | None
    usage: Usage | None


@dataclass(frozen=True, slots=True)
class Sample:
    tick: int                    # 1, 2, ...: a client asks for the samples after the last tick it saw
    t: float                     # wall clock at the tick
    requests: int                # requests that ended since the previous tick
    errors: int                  # of those, failed (no answer, cut off, internal error)
    failovers: int               # attempts abandoned before a first byte
    fences: int                  # replicas fenced since the previous tick
    prompt_tokens: int           # engine-reported, of the requests that ended
    cached_tokens: int
    in_flight: int               # requests in flight at the tick, every replica
    cache_ratio: float | None    # cached / prompt tokens over the last `window` samples
    ttft_p50: float | None       # seconds, over the last `window` samples: routed requests that got a first byte
    ttft_p90: float | None
    ttft_p99: float | None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class ReplicaFigures:
    """One replica as the requests it answered tell it."""

    requests: int = 0           # answered (any status) since start
    prompt_tokens: int = 0      # engine-reported, since start
    cached_tokens: int = 0
    sessions: int = 0           # conversations whose last answered turn it served within SESSION_IDLE_S
    ring_requests: int = 0      # over the samples in the ring
    ring_prompt: int = 0
    ring_cached: int = 0

    @property
    def cache_ratio(self) -> float | None:
        """Cached / prompt tokens over the ring (the last few minutes); None before any usage."""
        return self.ring_cached / self.ring_prompt if self.ring_prompt else None


@dataclass(slots=True)
class _Second:
    """What one sample added, kept to take it out of the windows again."""

    ttft: dict[int, int] = field(default_factory=dict)               # bucket -> requests
    replicas: dict[int, list[int]] = field(default_factory=dict)     # replica -> [requests, prompt, cached]
    prompt: int = 0
    cached: int = 0


@dataclass(slots=True)
class Totals:
    requests: int = 0
    errors: int = 0
    failovers: int = 0
    fences: int = 0


def ttft_bucket(seconds: float) -> int:
    if seconds <= TTFT_BASE_S:
        return 0
    return min(int(math.log(seconds / TTFT_BASE_S) / math.log(TTFT_RATIO)) + 1, TTFT_BUCKETS - 1)


def bucket_value(b: int) -> float:
    """A bucket's representative: the geometric middle of its bounds."""
    if b == 0:
        return TTFT_BASE_S
    return TTFT_BASE_S * TTFT_RATIO ** (b - 0.5)


def percentile(counts: Sequence[int], q: float) -> float | None:
    """The q-quantile (0 < q <= 1) of a bucket histogram; None when it is empty."""
    total = sum(counts)
    if not total:
        return None
    rank, seen = q * total, 0
    for b, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return bucket_value(b)
    return bucket_value(len(counts) - 1)


class Samples:
    def __init__(self, replicas: int, history: int = HISTORY, window: int = WINDOW, recent: int = RECENT,
                 pending: int = PENDING, sessions: int = SESSIONS, session_idle_s: float = SESSION_IDLE_S):
        if not 1 <= window <= history:
            raise ValueError("need 1 <= window <= history")
        self.history, self.window, self.session_idle_s = history, window, session_idle_s
        self.ring: deque[Sample] = deque()
        self._seconds: deque[_Second] = deque()  # beside the ring, one per sample
        self.recent: deque[tuple[int, Finished]] = deque(maxlen=recent)  # (tick it was folded in, request)
        self._pending_cap = pending
        self._pending: deque[Finished] = deque(maxlen=pending)
        self.finished = 0     # requests recorded since start
        self._folded = 0      # of those, counted in a sample
        self.ticks = 0
        self.totals = Totals()
        self.replicas = [ReplicaFigures() for _ in range(replicas)]
        self._ttft = [0] * TTFT_BUCKETS  # the window's histogram
        self._prompt = self._cached = 0  # the window's tokens
        self._keys = SessionKeys(sessions)
        self._sessions_cap = sessions
        self._where: OrderedDict[int, tuple[int, float]] = OrderedDict()  # conversation -> (replica, last turn)
        self._last_fence = -math.inf  # when the latest fence counted happened (the fleet's wall-clock stamp)

    # --- the request path ------------------------------------------------------------------
    def record(self, o: Finished) -> None:
        """A request ended (Recorder.finish): kept for the next tick, nothing computed."""
        self.finished += 1
        self._pending.append(o)

    # --- once a second ---------------------------------------------------------------------
    def tick(self, now: float, views: Sequence[ReplicaView]) -> Sample:
        """Fold the requests that ended since the last tick into a new sample; `now` is the wall clock."""
        batch, self._pending = self._pending, deque(maxlen=self._pending_cap)
        self.ticks += 1
        second, errors, failovers = _Second(), 0, 0
        for o in batch:
            errors += o.result in FAILED
            failovers += sum("failed" in a for a in o.attempts)
            if o.choice is not None and o.ttfb is not None:
                b = ttft_bucket(o.ttfb)
                second.ttft[b] = second.ttft.get(b, 0) + 1
            i = o.replica
            if i is None:
                continue
            row = second.replicas.setdefault(i, [0, 0, 0])
            row[0] += 1
            if o.usage is not None:
                row[1] += o.usage.prompt_tokens
                row[2] += o.usage.cached_tokens
            if o.result == "ok" and o.choice is not None and o.choice.decision.fingerprint.blocks:
                self._turn(self._keys.key(o.choice.decision.fingerprint.blocks), i, now)
        for _, prompt, cached in second.replicas.values():
            second.prompt += prompt
            second.cached += cached
        self._expire_sessions(now)
        fenced = [e["at"] for v in views for e in v.history if e["event"] == "fenced" and e["at"] > self._last_fence]
        fences, self._last_fence = len(fenced), max(fenced, default=self._last_fence)
        requests, self._folded = self.finished - self._folded, self.finished
        t = self.totals
        t.requests, t.errors, t.failovers, t.fences = (t.requests + requests, t.errors + errors,
                                                       t.failovers + failovers, t.fences + fences)
        self._count(second)
        self._seconds.append(second)
        if len(self._seconds) > self.window:  # out of the window, still in the ring
            self._window(self._seconds[-self.window - 1], -1)
        if len(self._seconds) > self.history:
            self._ring(self._seconds.popleft(), -1)
            self.ring.popleft()
        sample = Sample(self.ticks, now, requests, errors, failovers, fences, second.prompt, second.cached,
                        sum(v.in_flight for v in views), self._cached / self._prompt if self._prompt else None,
                        percentile(self._ttft, 0.5), percentile(self._ttft, 0.9), percentile(self._ttft, 0.99))
        self.ring.append(sample)
        for o in list(batch)[-(self.recent.maxlen or 0):]:
            self.recent.append((self.ticks, o))
        return sample

    def _count(self, s: _Second) -> None:
        """A new second: into the window, the ring and the totals since start."""
        self._window(s, +1)
        self._ring(s, +1)
        for i, (requests, prompt, cached) in s.replicas.items():
            f = self.replicas[i]
            f.requests, f.prompt_tokens, f.cached_tokens = (f.requests + requests, f.prompt_tokens + prompt,
                                                            f.cached_tokens + cached)

    def _window(self, s: _Second, sign: int) -> None:
        for b, n in s.ttft.items():
            self._ttft[b] += sign * n
        self._prompt += sign * s.prompt
        self._cached += sign * s.cached

    def _ring(self, s: _Second, sign: int) -> None:
        for i, (requests, prompt, cached) in s.replicas.items():
            f = self.replicas[i]
            f.ring_requests += sign * requests
            f.ring_prompt += sign * prompt
            f.ring_cached += sign * cached

    def _turn(self, key: int, replica: int, now: float) -> None:
        """A conversation's turn was answered by `replica`: it lives there now."""
        before = self._where.pop(key, None)
        if before is not None:
            self.replicas[before[0]].sessions -= 1
        self._where[key] = (replica, now)
        self.replicas[replica].sessions += 1
        if len(self._where) > self._sessions_cap:
            self._forget_oldest()

    def _expire_sessions(self, now: float) -> None:
        while self._where and next(iter(self._where.values()))[1] < now - self.session_idle_s:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        _, (replica, _) = self._where.popitem(last=False)
        self.replicas[replica].sessions -= 1

    # --- readers -----------------------------------------------------------------------------
    @property
    def sessions(self) -> int:
        """Conversations with an answered turn within SESSION_IDLE_S, every replica."""
        return len(self._where)

    def samples_after(self, tick: int) -> list[Sample]:
        """The samples newer than `tick`, oldest first."""
        return [s for s in self.ring if s.tick > tick]

    def recent_after(self, tick: int, n: int) -> list[Finished]:
        """At most `n` of the kept requests folded in after `tick`, newest first."""
        out = []
        for folded, o in reversed(self.recent):
            if folded <= tick or len(out) >= n:
                break
            out.append(o)
        return out

    def find(self, request_id: str) -> Finished | None:
        """A kept request by its X-Ramjet-Request-Id; None once it is no longer among the last `recent`."""
        return next((o for _, o in reversed(self.recent) if o.request_id == request_id), None)

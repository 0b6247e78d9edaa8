"""The dashboard's pure parts: its history (proxy/samples.py: one sample a second, bounded, from the requests'
records alone) and its page's files in the package."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from ramjet.balancer.cluster.replica import ReplicaView
from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.proxy.decide import Choice
from ramjet.balancer.proxy.outcome import Outcome
from ramjet.balancer.proxy.samples import Samples, percentile, ttft_bucket
from ramjet.routing.policy import Params
from ramjet.routing.router import Router
from ramjet.usage import Usage

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
N = 4
REPLICAS = [Replica(i, "http://e0", i, "engine0", "http://e0") for i in range(N)]
ROUTER = Router("relative", Params(), [10_000] * N, 1 << 20)


def outcome(replica: int | None = 0, text: str = "hello", ttfb: float | None = 0.1, prompt: int = 100,
            cached: int = 50, result: str = "ok", failed: tuple[str, ...] = (), request_id: str = "r",
            then: tuple[str, ...] = ()) -> Outcome:
    """A finished chat request as the forwarder leaves it, decided by a real router; `then`: later messages."""
    body = {"model": "m", "messages": [{"role": "user", "content": text},
                                       *({"role": "assistant", "content": m} for m in then)]}
    decision = ROUTER.decide("chat", body, [0.0] * N, [True] * N)
    o = Outcome("chat", request_id=request_id, choice=Choice(decision, [0.0] * N, [True] * N, None, 0.0001))
    for i, reason in enumerate(failed):
        o.failed_attempt((replica or 0) + i + 1, reason)
    if replica is not None:
        o.answered(replica, 200 if result == "ok" else 502)
        o.usage = Usage(prompt, cached, 4)
    o.status, o.result, o.ttfb = (200 if result == "ok" else 502), result, ttfb
    return o


def views(fences: dict[int, list[float]] | None = None, in_flight: int = 0) -> list[ReplicaView]:
    fences = fences or {}
    return [ReplicaView(r, not fences.get(i), False, "rank_timeout" if fences.get(i) else "", in_flight, 0.0, 0.0, 0,
                        tuple({"at": at, "event": "fenced", "reason": "rank_timeout"} for at in fences.get(i, ())))
            for i, r in enumerate(REPLICAS)]


def test_a_request_is_only_kept_until_the_tick_which_counts_it():
    s = Samples(N)
    s.record(outcome(replica=1, prompt=1000, cached=800))
    s.record(outcome(replica=2, prompt=500, cached=0, failed=("http_5xx",)))
    s.record(outcome(replica=None, ttfb=None, result="failed", failed=("connect", "connect")))
    assert len(s.ring) == 0 and s.replicas[1].requests == 0  # nothing computed before the tick
    sample = s.tick(100.0, views(in_flight=2))
    assert (sample.requests, sample.errors, sample.failovers) == (3, 1, 3)
    assert (sample.prompt_tokens, sample.cached_tokens, sample.in_flight) == (1500, 800, 8)
    assert sample.cache_ratio == pytest.approx(800 / 1500)
    assert [f.requests for f in s.replicas] == [0, 1, 1, 0]
    assert s.replicas[1].cache_ratio == pytest.approx(0.8) and s.replicas[0].cache_ratio is None
    assert (s.totals.requests, s.totals.errors, s.totals.failovers) == (3, 1, 3)
    empty = s.tick(101.0, views())  # a quiet second
    assert (empty.requests, empty.prompt_tokens) == (0, 0) and empty.cache_ratio == pytest.approx(800 / 1500)


def test_the_window_forgets_old_seconds_and_the_ring_keeps_only_its_history():
    s = Samples(N, history=5, window=2)
    s.record(outcome(replica=0, prompt=100, cached=100, ttfb=2.0))
    s.tick(1.0, views())
    s.record(outcome(replica=1, prompt=100, cached=0, ttfb=0.01))
    second = s.tick(2.0, views())
    assert second.cache_ratio == pytest.approx(0.5)
    assert second.ttft_p50 == pytest.approx(0.01, rel=0.1) and second.ttft_p99 == pytest.approx(2.0, rel=0.1)
    third = s.tick(3.0, views())  # the first second left the window
    assert third.cache_ratio == 0.0 and third.ttft_p99 == pytest.approx(0.01, rel=0.1)
    assert s.tick(4.0, views()).ttft_p50 is None and s.tick(4.5, views()).cache_ratio is None
    for t in range(5, 9):
        s.tick(float(t), views())
    assert [x.tick for x in s.ring] == [5, 6, 7, 8, 9] and len(s.ring) == 5
    # the per-replica "lately" figures leave with the ring; totals since start stay
    assert s.replicas[0].ring_requests == 0 and s.replicas[0].requests == 1 and s.replicas[0].cache_ratio is None


def test_ttft_percentiles_are_within_ten_percent():
    values = [0.002 * 1.07 ** k for k in range(200)]  # 2 ms .. 1.5 s, spread evenly on a log scale
    counts = [0] * 80
    for v in values:
        counts[ttft_bucket(v)] += 1
    for q in (0.5, 0.9, 0.99):
        exact = sorted(values)[int(q * len(values)) - 1]
        assert percentile(counts, q) == pytest.approx(exact, rel=0.1)
    assert percentile([0] * 80, 0.5) is None
    assert ttft_bucket(0.0) == 0 and ttft_bucket(1e9) == 79


def test_sessions_live_where_their_last_turn_was_answered_and_leave_when_idle():
    s = Samples(N, session_idle_s=60)
    harness = "a long shared harness " * 400
    s.record(outcome(replica=1, text=harness + "task one"))
    s.record(outcome(replica=2, text=harness + "task two"))
    s.tick(10.0, views())
    assert [f.sessions for f in s.replicas] == [0, 1, 1, 0] and s.sessions == 2
    # task one's next turn (its prompt extends the last) lands on replica 3: it moves; a failed turn counts nowhere
    s.record(outcome(replica=3, text=harness + "task one", then=("an answer " * 300,)))
    s.record(outcome(replica=0, text=harness + "task three", result="failed"))
    s.tick(50.0, views())
    assert [f.sessions for f in s.replicas] == [0, 0, 1, 1] and s.sessions == 2
    s.tick(75.0, views())  # task two's last turn was 65 s ago
    assert [f.sessions for f in s.replicas] == [0, 0, 0, 1] and s.sessions == 1


def test_sessions_are_bounded():
    s = Samples(N, sessions=3)
    for k in range(10):
        s.record(outcome(replica=k % N, text=f"conversation {k} " * 100))
    s.tick(1.0, views())
    assert s.sessions == 3 and sum(f.sessions for f in s.replicas) == 3


def test_fences_are_counted_once_in_the_second_they_happened():
    s = Samples(N)
    assert s.tick(10.0, views({2: [9.5]})).fences == 1  # before the first tick: since start
    assert s.tick(11.0, views({2: [9.5], 3: [10.2, 10.9]})).fences == 2
    assert s.tick(12.0, views({2: [9.5], 3: [10.2, 10.9]})).fences == 0
    assert s.tick(13.0, views({2: [9.5, 12.0005], 3: [10.2, 10.9]})).fences == 1  # stamped just after the last tick
    assert s.totals.fences == 4


def test_between_ticks_at_most_pending_requests_are_looked_at_and_all_are_counted():
    s = Samples(N, pending=10, recent=4)
    for k in range(25):
        s.record(outcome(replica=0, prompt=10, cached=10, request_id=f"id-{k}"))
    sample = s.tick(1.0, views())
    assert sample.requests == 25 and sample.prompt_tokens == 100  # counted all, looked at the last ten
    assert [o.request_id for o in s.recent_after(0, 10)] == ["id-24", "id-23", "id-22", "id-21"]


def test_recent_requests_newer_than_a_tick_newest_first_and_found_by_id():
    s = Samples(N, recent=3)
    s.record(outcome(request_id="a"))
    s.tick(1.0, views())
    s.record(outcome(request_id="b"))
    s.record(outcome(request_id="c"))
    s.tick(2.0, views())
    assert [o.request_id for o in s.recent_after(0, 10)] == ["c", "b", "a"]
    assert [o.request_id for o in s.recent_after(1, 10)] == ["c", "b"]
    assert [o.request_id for o in s.recent_after(2, 10)] == [] and len(s.recent_after(0, 2)) == 2
    assert [x.tick for x in s.samples_after(1)] == [2]
    s.record(outcome(request_id="d"))
    s.tick(3.0, views())
    assert s.find("d").request_id == "d" and s.find("a") is None  # only the last three are kept


def test_window_must_fit_in_the_history():
    with pytest.raises(ValueError):
        Samples(N, history=10, window=11)


def test_the_page_s_files_ship_in_the_package():
    """A non-editable install (and the Docker image, which pip-installs ramjet/balancer) carries the page."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {p for pattern in data["ramjet.balancer.edge"] for p in (ROOT / "ramjet/balancer/edge").glob(pattern)}
    assert shipped == set((ROOT / "ramjet/balancer/edge/static").iterdir())
    assert {p.name for p in shipped} >= {"dashboard.html", "dashboard.js", "dashboard.css"}


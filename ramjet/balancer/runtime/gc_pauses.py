"""How long Python's cyclic garbage collector stopped the balancer, by generation (ramjet_gc_pause_seconds).

A collection stops every request in the process: the oldest generation walks every tracked object,
and the balancer's state (the prefix index, precise mode's views, the requests in flight) grows with
the fleet. The collector calls back at each collection's start and stop; the callback only notes
the pause in a bounded deque (no lock: it may run in any thread, inside any allocation, even one made
while a metric's lock is held), and the loop-lag watcher moves the notes into the histogram.
"""

from __future__ import annotations

import collections
import gc
import time

from ramjet.balancer.metrics import Metrics


class GcPauses:
    def __init__(self, metrics: Metrics, keep: int = 4096):
        self.metrics = metrics
        self._notes: collections.deque[tuple[int, float]] = collections.deque(maxlen=keep)  # (generation, s)
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._notes.append((info["generation"], time.perf_counter() - self._started))

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        self.flush()

    def flush(self) -> None:
        """Move the pauses noted since the last flush into the histogram (on the event loop)."""
        notes, pauses = self._notes, self.metrics.gc_pauses
        while notes:
            generation, seconds = notes.popleft()
            pauses.labels(str(generation)).observe(seconds)

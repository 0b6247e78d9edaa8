"""When each request of a trace window is sent (pure).

Three clocks: trace time (the file's `timestamp`, ms), engine time (what the
simulator models and what every reported figure is in) and real time (what the
client sleeps). The window is cut in trace time: `start` and `minutes` name the
trace's own minutes. `speedup` compresses trace time into engine time (2: the
requests of one trace minute arrive within 30 engine seconds, twice the rate),
and the time scale S compresses engine time into real time, as the simulator's
`--time-scale S` does. A request at trace time t arrives (t - start) / speedup
engine seconds, and that / S real seconds, after the replay starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ramjet.bench.trace_load import TraceRequest

MS_PER_MINUTE = 60_000


@dataclass(frozen=True)
class Window:
    start_minutes: float = 0.0
    minutes: float | None = None      # None: to the end of the trace
    speedup: float = 1.0

    def __post_init__(self):
        if not self.start_minutes >= 0:
            raise ValueError("start must be >= 0 minutes")
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError("minutes must be > 0")
        if not (self.speedup > 0 and math.isfinite(self.speedup)):
            raise ValueError("speedup must be a positive number")

    @property
    def start_ms(self) -> float:
        return self.start_minutes * MS_PER_MINUTE

    @property
    def end_ms(self) -> float:
        return math.inf if self.minutes is None else self.start_ms + self.minutes * MS_PER_MINUTE

    def select(self, requests: Sequence[TraceRequest]) -> list[TraceRequest]:
        """The requests whose timestamp falls in [start, start + minutes) of trace time."""
        return [r for r in requests if self.start_ms <= r.timestamp_ms < self.end_ms]

    def arrival(self, req: TraceRequest) -> float:
        """Engine seconds from the start of the replay to this request's arrival."""
        return (req.timestamp_ms - self.start_ms) / 1000.0 / self.speedup

    def span(self, requests: Sequence[TraceRequest]) -> float:
        """Engine seconds the window's arrivals take: its length, or up to the last request without one."""
        if self.minutes is not None:
            return self.minutes * 60.0 / self.speedup
        return max((self.arrival(r) for r in requests), default=0.0)


def real_seconds(engine_seconds: float, time_scale: float) -> float:
    """Real seconds the client waits for `engine_seconds` of a simulator running at `time_scale`."""
    return engine_seconds / time_scale

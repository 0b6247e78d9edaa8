"""Recent prompt demand per replica: what the sessions homed on it keep asking for.

Load says what is queued on a replica now; it cannot see that a replica whose
sessions are all between turns will be busy again in a few seconds. Demand is
an exponentially decayed sum of the prompt bytes each replica answered, so a
replica that already hosts more than its share of sessions takes fewer new
ones. The decay is per answered request, not per second: the window is about
WINDOW_PER_REPLICA requests per replica whatever the request rate, so it
behaves the same in front of a time-scaled simulator.
"""

from __future__ import annotations

WINDOW_PER_REPLICA = 32


class Demand:
    def __init__(self, replicas: int):
        self._values = [0.0] * replicas
        self._keep = 1.0 - 1.0 / (WINDOW_PER_REPLICA * max(replicas, 1))

    def record(self, replica: int, prompt_bytes: int) -> None:
        keep = self._keep
        values = self._values
        for i, v in enumerate(values):
            values[i] = v * keep
        values[replica] += prompt_bytes

    def clear(self, replica: int) -> None:
        """The replica's engine restarted: its sessions must find homes again."""
        self._values[replica] = 0.0

    def shares(self, serving: list[bool]) -> list[float]:
        """Each replica's demand over the serving replicas' average (1.0 = average)."""
        live = [v for v, s in zip(self._values, serving) if s] or self._values
        mean = sum(live) / len(live)
        if mean <= 0:
            return [1.0] * len(self._values)
        return [v / mean for v in self._values]

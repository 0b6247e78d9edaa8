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

from itertools import compress, repeat
from operator import mul, truediv

WINDOW_PER_REPLICA = 32


class Demand:
    def __init__(self, replicas: int):
        self._values = [0.0] * replicas
        self._keep = 1.0 - 1.0 / (WINDOW_PER_REPLICA * max(replicas, 1))

    def record(self, replica: int, prompt_bytes: int) -> None:
        values = self._values
        values[:] = map(mul, values, repeat(self._keep))  # v * keep for every replica, in C
        values[replica] += prompt_bytes

    def clear(self, replica: int) -> None:
        """The replica's engine restarted: its sessions must find homes again."""
        self._values[replica] = 0.0

    def snapshot(self) -> list[float]:
        """Each replica's decayed demand now (a copy: `shares` of it stay what they were)."""
        return self._values.copy()

    def shares(self, serving: list[bool]) -> list[float]:
        """Each replica's demand over the serving replicas' average (1.0 = average)."""
        return shares(self._values, serving)


def shares(values: list[float], serving: list[bool], replicas: list[int] | None = None) -> list[float]:
    """Each replica's demand in `values` over the serving replicas' average (1.0 = average); of `replicas` only,
    in their order, when given."""
    live = list(compress(values, serving)) or values
    mean = sum(live) / len(live)
    if replicas is not None:
        return [1.0] * len(replicas) if mean <= 0 else [values[i] / mean for i in replicas]
    if mean <= 0:
        return [1.0] * len(values)
    return list(map(truediv, values, repeat(mean)))

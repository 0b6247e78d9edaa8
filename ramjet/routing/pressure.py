"""Whether the caches are oversubscribed: continuing conversations keep finding their own history gone.

A continuing turn re-sends its conversation's previous prompt; when no replica still
holds all of it, a cache evicted a live conversation. While that happens to more than
PRESSURE of them, placing a new conversation away from its shared prefix would cost
room the live ones need (routing/router.py). Counted per continuing request, not per
second, like routing/demand.py: the same behind a time-scaled simulator.
"""

from __future__ import annotations

PRESSURE = 0.05       # share of continuing requests that found their history cut, above which caches are full
WINDOW = 64           # continuing requests the share is averaged over (exponentially)


class Pressure:
    def __init__(self):
        self._share = 0.0

    def observe(self, cut: bool) -> None:
        self._share += (float(cut) - self._share) / WINDOW

    def high(self) -> bool:
        return self._share > PRESSURE

"""The engine-wide decode clock: DP-attention ranks share forward passes, so a prefill anywhere slows decode everywhere.

Ticks advance decode by this clock, not by the wall: it runs at full speed while no
rank prefills and at `share` of it while any does. The share is fitted to the
article's measurements (docs/simulator.md, Calibration); strict lockstep, one
decode step per chunk-long pass, would give about 5%.
"""

from __future__ import annotations

import asyncio


class DecodeClock:
    def __init__(self, share: float):
        self.share = share
        self._prefilling = 0  # ranks prefilling now
        self._since = 0.0     # loop time the clock last changed speed
        self._total = 0.0     # the clock's reading at that moment

    def start(self) -> None:
        self._since = asyncio.get_running_loop().time()

    def prefill_begins(self) -> None:
        if self._prefilling == 0:
            self._total, self._since = self.read(), asyncio.get_running_loop().time()
        self._prefilling += 1

    def prefill_ends(self) -> None:
        if self._prefilling == 1:
            self._total, self._since = self.read(), asyncio.get_running_loop().time()
        self._prefilling -= 1

    def read(self) -> float:
        """Real seconds of decode progress so far."""
        speed = self.share if self._prefilling else 1.0
        return self._total + speed * (asyncio.get_running_loop().time() - self._since)

"""RJ_ROUTE_JOURNAL: one content-free JSON line per routing decision, for offline re-scoring."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson


class Journal:
    def __init__(self, target: str | Path):
        if target == "stdout":
            self._out = sys.stdout.buffer
            self._own = False
        else:
            self._out = open(target, "ab", buffering=0)
            self._own = True

    def write(self, record: dict) -> None:
        self._out.write(orjson.dumps(record) + b"\n")
        if not self._own:
            self._out.flush()

    def close(self) -> None:
        if self._own:
            self._out.close()

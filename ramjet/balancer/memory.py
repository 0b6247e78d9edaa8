"""The balancer's memory across restarts (RJ_STATE_FILE): what each replica holds, saved now and then.

A balancer that restarts empty sends every live session to whichever rank is least
loaded, and each pays a full prefill there. So it saves both indexes every
RJ_STATE_INTERVAL_MS and when it stops: the approximate one, and in precise mode the
blocks the engine reported, with the last event batch each replica's stream
delivered. At start it takes them back, replica by replica, matched by engine URL
and DP rank; a new replica, or a file of another deployment, starts empty.

A saved precise view is vouched for by the engine itself: the replica's stream
resumes at the saved batch, which the replay must bring back unchanged. If it cannot
(the engine ran past its replay buffer while the balancer was down, or restarted),
the replica routes on the approximate index, restored too, until its predictions
agree again (ramjet.kvevents.subscriber, ramjet.balancer.precise).

The file is msgpack, written beside itself and renamed, so a crash mid-write leaves
the previous one. A file that cannot be read is logged and set aside: the balancer
starts empty rather than not at all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import msgpack

from ramjet.balancer.precise import PreciseMode
from ramjet.balancer.topology import Replica
from ramjet.routing.router import Router

log = logging.getLogger("ramjet.memory")

FORMAT = "ramjet-state/1"
_INT64 = range(-(1 << 63), 1 << 64)  # what msgpack packs as an integer; engines' hashes can be wider


def _identity(r: Replica) -> str:
    return f"{r.engine}#{'' if r.dp_rank is None else r.dp_rank}"


def _packable(h: int) -> int | bytes:
    return h if h in _INT64 else h.to_bytes((h.bit_length() + 7) // 8, "big")


def _int(h: int | bytes) -> int:
    return int.from_bytes(h, "big") if isinstance(h, bytes) else h


class Memory:
    def __init__(self, path: Path, interval_s: float, replicas: list[Replica], router: Router,
                 precise: PreciseMode | None):
        self.path, self.interval_s = path, interval_s
        self.replicas, self.router, self.precise = replicas, router, precise

    def snapshot(self) -> dict:
        """Both indexes, per replica, as plain values (taken on the event loop, between requests)."""
        out = {}
        for i, r in enumerate(self.replicas):
            saved: dict = {"approximate": self.router.index.export(i)}
            view = self.precise.export_view(i) if self.precise is not None else None
            if view is not None:
                view["index"]["theirs"] = [_packable(h) for h in view["index"]["theirs"]]
                saved["precise"] = view
            out[_identity(r)] = saved
        return {"format": FORMAT, "saved_at": time.time(), "replicas": out}

    def write(self, snapshot: dict) -> None:
        """Replace the file at once (no reader ever sees half of one)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(msgpack.packb(snapshot))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    async def save(self) -> None:
        snapshot = self.snapshot()
        try:
            await asyncio.to_thread(self.write, snapshot)
        except OSError as e:
            log.warning("could not save the routing state to %s: %s", self.path, e)

    def restore(self) -> int:
        """Take back what the file says each replica held; the number of replicas restored."""
        try:
            data = msgpack.unpackb(self.path.read_bytes(), strict_map_key=False)
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, msgpack.UnpackException) as e:
            log.warning("ignoring the routing state in %s, which cannot be read (%s); starting empty", self.path, e)
            return 0
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("replicas"), dict):
            log.warning("ignoring %s: not a %s file; starting empty", self.path, FORMAT)
            return 0
        restored = 0
        for i, r in enumerate(self.replicas):
            saved = data["replicas"].get(_identity(r))
            if not isinstance(saved, dict):
                continue
            try:
                self.router.index.restore(i, [int(h) for h in saved.get("approximate", [])])
                view = saved.get("precise")
                if view is not None and self.precise is not None:
                    view["index"]["theirs"] = [_int(h) for h in view["index"]["theirs"]]
                    self.precise.restore_view(i, view)
            except (TypeError, ValueError, KeyError) as e:
                self.router.index.clear(i)
                log.warning("upstream %s: ignoring its saved state (%s)", r.ordinal, e)
                continue
            restored += 1
        age = time.time() - data.get("saved_at", time.time()) if isinstance(data.get("saved_at"), float) else 0.0
        log.info("restored the routing state of %d of %d replicas from %s (saved %.0f s ago)",
                 restored, len(self.replicas), self.path, age)
        return restored

    async def keep(self) -> None:
        """Save every interval, until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.save()

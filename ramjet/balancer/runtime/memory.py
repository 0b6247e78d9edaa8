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

The approximate index is the balancer's guess of what an engine's cache holds; it is
worth nothing once the engine restarted while the balancer was down. So each save also
records who each replica's engine is (engines/report.Identity: its launch value,
SGLang's `/server_info` `startup_time` or vLLM's `process_start_time_seconds`, and
the rank's prefill counter, which restarts at zero), and at start a replica's
approximate index comes back only if its engine says, within the client's timeout
(10 s at start, as engine discovery: SGLang's `/server_info` asks every scheduler and
a busy engine answers slowly), that it is the same process. A
restarted engine, or one that cannot confirm it (down, or saying neither), starts
empty; each is logged and counted (`ramjet_state_restores_total{result}`).

The file is msgpack, written beside itself and renamed, so a crash mid-write leaves
the previous one. Its body carries an xxh3-128 digest, so a file cut short, corrupted
on disk or edited by hand is told from a good one before anything in it is used. A file
that cannot be read, or fails its digest, is logged, counted
(`ramjet_state_restores_total{result="unreadable"}`) and set aside: the balancer starts
empty rather than not at all. A replica whose entry does not fit what it must be (a
digest-less file of an earlier release, edited) is logged, counted (`invalid`) and starts
empty; the others are restored.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import msgpack
import xxhash

from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.engines.client import EngineClient, identity_of
from ramjet.balancer.engines.report import Identity, same_engine
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.precise.mode import PreciseMode
from ramjet.routing.router import Router

log = logging.getLogger("ramjet.memory")

FORMAT = "ramjet-state/2"  # {"format", "saved_at", "digest": xxh3-128 hex of "body", "body": packed replicas}
EARLIER = "ramjet-state/1"  # the same replicas inline, no digest: still read
_INT64 = range(-(1 << 63), 1 << 64)  # what msgpack packs as an integer; engines' hashes can be wider


def _identity(r: Replica) -> str:
    return f"{r.engine}#{'' if r.dp_rank is None else r.dp_rank}"


def _said(identity: Identity | None) -> str:
    if identity is None:
        return "nothing"
    launch = identity.launch if identity.launch is None or len(identity.launch) < 80 else identity.launch[:77] + "..."
    counter = "?" if identity.prefilled is None else identity.prefilled
    return f"launch {launch or '?'}, prefill counter {counter}"


def _packable(h: int) -> int | bytes:
    return h if h in _INT64 else h.to_bytes((h.bit_length() + 7) // 8, "big")


def _int(h: int | bytes) -> int:
    return int.from_bytes(h, "big") if isinstance(h, bytes) else h


class Memory:
    def __init__(self, path: Path, interval_s: float, replicas: list[Replica], router: Router,
                 precise: PreciseMode | None, engines: EngineClient | None = None, metrics: Metrics | None = None,
                 final_check_s: float = 2.0, writes: bool = True):
        self.path, self.interval_s = path, interval_s
        self.replicas, self.router, self.precise = replicas, router, precise
        self.engines, self.metrics = engines, metrics
        self.final_check_s = final_check_s  # at shutdown, a slow engine keeps the identity it last gave
        self.writes = writes  # False: taken back at start, never written (RJ_WORKERS: worker 0 writes it)
        self.known: dict[str, Identity] = {}  # who each replica's engine was when last asked

    async def identities(self, within_s: float | None = None) -> dict[str, Identity | None]:
        """Who each replica's engine is now, by replica; None where it did not say in time (or no client)."""
        if self.engines is None:
            return {}
        engines = sorted({r.engine for r in self.replicas})
        within_s = self.engines.timeout_s if within_s is None else within_s
        found = dict(zip(engines, await asyncio.gather(*(self._identify(e, within_s) for e in engines))))
        now = {_identity(r): identity_of(found[r.engine], r.dp_rank) for r in self.replicas}
        self.known.update({k: v for k, v in now.items() if v is not None})
        return now

    async def _identify(self, engine: str, within_s: float):
        try:
            async with asyncio.timeout(within_s):
                return await self.engines.identify(engine)
        except TimeoutError:
            return None

    async def start(self) -> int:
        """Ask every engine who it is, then take back what may be taken back; the number of replicas restored."""
        return self.restore(await self.identities())

    def snapshot(self) -> dict:
        """Both indexes, per replica, as plain values (taken on the event loop, between requests)."""
        out = {}
        for i, r in enumerate(self.replicas):
            saved: dict = {"approximate": self.router.index.export(i)}
            known = self.known.get(_identity(r))
            if known is not None:
                saved["engine"] = known.to_saved()
            view = self.precise.export_view(i) if self.precise is not None else None
            if view is not None:
                view["index"]["theirs"] = [_packable(h) for h in view["index"]["theirs"]]
                saved["precise"] = view
            out[_identity(r)] = saved
        return {"format": FORMAT, "saved_at": time.time(), "replicas": out}

    def write(self, snapshot: dict) -> None:
        """Replace the file at once (no reader ever sees half of one)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        body = msgpack.packb(snapshot["replicas"])
        framed = {"format": snapshot["format"], "saved_at": snapshot["saved_at"],
                  "digest": xxhash.xxh3_128_hexdigest(body), "body": body}
        with open(tmp, "wb") as f:
            f.write(msgpack.packb(framed))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    async def save(self, final: bool = False) -> None:
        """Write the file; `final` (at shutdown): engines get only `final_check_s` to say who they are."""
        if not self.writes:
            return
        await self.identities(self.final_check_s if final else None)  # one that does not answer keeps its last
        snapshot = self.snapshot()
        try:
            await asyncio.to_thread(self.write, snapshot)
        except OSError as e:
            log.warning("could not save the routing state to %s: %s", self.path, e)

    def restore(self, engines: dict[str, Identity | None] | None = None) -> int:
        """Take back what the file says each replica held; the number of replicas restored.

        `engines`: who each replica's engine is now (`identities()`); a replica's approximate
        index comes back only if its engine is the one that was saved. None: not checked.
        """
        try:
            data = self._read()
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, msgpack.UnpackException) as e:
            log.warning("ignoring the routing state in %s, which cannot be read (%s); starting empty", self.path, e)
            self._count("unreadable")
            return 0
        restored = 0
        for i, r in enumerate(self.replicas):
            saved = data["replicas"].get(_identity(r))
            if not isinstance(saved, dict):
                continue
            try:
                approximate = engines is None or self._same_engine(r, saved, engines)
                if approximate:
                    self.router.index.restore(i, [int(h) for h in saved.get("approximate", [])], time.monotonic())
                view = saved.get("precise")
                precise = view is not None and self.precise is not None
                if precise:  # vouched for by the engine's own replay, not by this check (precise.py)
                    view["index"]["theirs"] = [_int(h) for h in view["index"]["theirs"]]
                    self.precise.restore_view(i, view)
            except (TypeError, ValueError, KeyError, AttributeError) as e:
                self.router.index.clear(i)
                if self.precise is not None:
                    self.precise.forget(i)
                self._count("invalid")
                log.warning("upstream %s: ignoring its saved state (%s)", r.ordinal, e)
                continue
            if approximate and engines is not None:
                self._count("restored")
            restored += approximate or precise
        age = time.time() - data.get("saved_at", time.time()) if isinstance(data.get("saved_at"), float) else 0.0
        log.info("restored the routing state of %d of %d replicas from %s (saved %.0f s ago)",
                 restored, len(self.replicas), self.path, age)
        return restored

    def _read(self) -> dict:
        """The file's content, checked: ValueError for a file cut short, corrupted, edited or of another kind."""
        data = msgpack.unpackb(self.path.read_bytes(), strict_map_key=False)
        if not isinstance(data, dict) or data.get("format") not in (FORMAT, EARLIER):
            raise ValueError(f"not a {FORMAT} file")
        if data["format"] == FORMAT:
            body = data.get("body")
            if not isinstance(body, bytes) or data.get("digest") != xxhash.xxh3_128_hexdigest(body):
                raise ValueError("its digest does not match: cut short, corrupted or edited")
            data["replicas"] = msgpack.unpackb(body, strict_map_key=False)
        if not isinstance(data.get("replicas"), dict):
            raise ValueError("it holds no replicas")
        return data

    def _same_engine(self, r: Replica, saved: dict, engines: dict[str, Identity | None]) -> bool:
        """Whether replica r's engine is still the process the file describes; logged and counted when not."""
        then, now = Identity.from_saved(saved.get("engine")), engines.get(_identity(r))
        verdict = same_engine(then, now)
        if verdict:
            return True
        if verdict is False:
            self._count("engine_restarted")
            log.warning("upstream %s (node %s, rank %s): its engine restarted since the state was saved (%s, "
                        "then %s); its approximate index starts empty", *r.labels, _said(now), _said(then))
        else:
            self._count("unconfirmed")
            log.warning("upstream %s (node %s, rank %s): cannot confirm its engine is the one the state was saved "
                        "from (now %s, then %s); its approximate index starts empty", *r.labels, _said(now),
                        _said(then))
        return False

    def _count(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.state_restores.labels(result).inc()

    async def keep(self) -> None:
        """Save every interval, until cancelled."""
        while self.writes:
            await asyncio.sleep(self.interval_s)
            await self.save()

"""RJ_ROUTE_JOURNAL: one content-free JSON line per routing decision, for offline replay (docs/replay.md).

The first line written by a balancer is a header with its routing settings, so a replay
rebuilds the recording's router without being told how it was configured. Writing is
best-effort: a full disk or a closed pipe loses journal lines, never a request.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import asdict
from pathlib import Path

import orjson

from ramjet.balancer.cluster.topology import Replica
from ramjet.config import Settings
from ramjet.routing.router import Router
from ramjet.routing.sessions import SessionKeys

FORMAT = 1  # the header's "journal" field: the record format's version

log = logging.getLogger("ramjet.journal")


def routing_header(router: Router, settings: Settings, replicas: list[Replica]) -> dict:
    """The header line: what a replay needs to rebuild the router that made the journal's decisions."""
    header = {"journal": FORMAT, "policy": router.policy.name, "params": asdict(router.params),
              "replicas": len(replicas),
              "index_capacities": [settings.index_capacity_for(r.kv_capacity_tokens) for r in replicas],
              "max_prefix_bytes": router.max_prefix_bytes,
              "new_sessions": "balance" if router.balance_new_sessions else "affinity",
              "session_hints": router.session_hints, "in_flight": router.in_flight is not None}
    if settings.route_host_tier_tokens:
        header["host_capacities"] = [settings.host_capacity_for()] * len(replicas)
        header["host_credit"] = router.host_credit
    if settings.load_model is not None:  # the Rust Ramjet's decode load model (a replay models ours: a note)
        header["load_model"] = asdict(settings.load_model)
    if settings.route_idle_decode_units:  # a replay models no decoding, so it cannot weigh it: a note
        header["idle_decode_units"] = settings.route_idle_decode_units
    return header


class Journal:
    def __init__(self, target: str | Path, header: dict | None = None):
        if target == "stdout":
            self._out = sys.stdout.buffer
            self._own = False
        else:
            self._out = open(target, "ab", buffering=0)  # noqa: SIM115 (open for the balancer's lifetime)
            self._own = True
        self.sessions = SessionKeys()  # conversation keys for the records (routing/sessions.py)
        self._failing = False
        if header is not None:
            self.write(header)

    def write(self, record: dict) -> None:
        """Append one line. A failure is logged once per run of failures and never raised."""
        try:
            self._out.write(orjson.dumps(record) + b"\n")
            if not self._own:
                self._out.flush()
        except (OSError, ValueError, TypeError) as e:  # ValueError: closed; TypeError: orjson's encode error
            if not self._failing:
                log.warning("routing journal: lines are being lost (%s)", e)
            self._failing = True
            return
        if self._failing:
            log.warning("routing journal: writing again")
            self._failing = False

    def close(self) -> None:
        if self._own:
            self._out.close()

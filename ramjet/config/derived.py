"""What the settings mean to the code that reads them: seconds, listener parts, the journal, index sizes.

A mixin of Settings (settings.py declares the fields): derived values only, nothing validated here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from ramjet.config.values import parse_addr
from ramjet.routing.decode_load import DEFAULT_DECODE_MAX_UNITS, LoadModel

BYTES_PER_TOKEN = 4  # canonical prompt bytes per token, roughly, for English text and code


def _seconds(ms_field: str) -> property:
    """A duration field (`*_ms`, as the variables are named) in seconds, as timers and httpx want it."""
    return property(lambda self: getattr(self, ms_field) / 1000, doc=f"{ms_field} in seconds")


def _addr_part(addr_field: str, part: int) -> property:
    """Host (part 0) or port (1) of a listener address; None when that listener is off."""
    return property(lambda self: None if (a := getattr(self, addr_field)) is None else parse_addr(a)[part])


class Derived:
    """Properties over Settings' fields (a mixin: `self` is the Settings instance)."""

    @property
    def upstreams(self) -> list[str]:
        """RJ_UPSTREAM as normalised URLs, in order (duplicates kept: DP_RANKS lists one URL per rank)."""
        return list(self.upstream)

    @property
    def policy_name(self) -> str:
        """The routing policy to build (ramjet.routing.policies.POLICY_NAMES): `load`, or the affinity basis."""
        return "load" if self.affinity == "load" else self.route_affinity_basis

    @property
    def balance_new_sessions(self) -> bool:
        """RJ_ROUTE_NEW_SESSIONS: `auto` (the default) is `balance`, in both modes.

        In precise mode a request also continues a conversation when an engine holds more of it than this
        balancer sent (routing/router.py), so several balancers judge new and continuing alike.
        """
        return self.route_new_sessions in ("auto", "balance")

    @property
    def journal_target(self) -> None | Literal["stdout"] | Path:
        """RJ_ROUTE_JOURNAL: off (None), JSON lines on stdout, or a file to append to."""
        if isinstance(self.route_journal, Path):
            return self.route_journal
        return "stdout" if self.route_journal else None

    @property
    def load_model(self) -> LoadModel | None:
        """The Rust Ramjet's decode load model, when any of its three variables is given; None: ours (units.py).

        Its defaults are the Rust Ramjet's: phase-aware off, decode weighting off (0 tokens per
        unit: one unit), at most min(4, RJ_ROUTE_MAX_LOAD_UNITS) decode units.
        """
        given = {"route_phase_aware_load", "route_decode_load_unit_tokens", "route_decode_max_load_units"}
        if not given & self.model_fields_set:
            return None
        cap = self.route_decode_max_load_units
        return LoadModel(bool(self.route_phase_aware_load), self.route_decode_load_unit_tokens or 0,
                         cap if cap is not None else min(DEFAULT_DECODE_MAX_UNITS, self.route_max_load_units))

    def index_capacity_for(self, kv_capacity_tokens: int | None = None) -> int:
        """Index entries (blocks) for one replica.

        An explicit RJ_ROUTE_INDEX_CAPACITY wins. Otherwise the replica's KV capacity
        (argument, else RJ_ROUTE_KV_CAPACITY_TOKENS) sizes it: a block of
        route_chunk_bytes holds about chunk/4 tokens, so the index remembers about
        as many blocks as the rank's cache can hold, and forgets as the cache would.
        """
        if "route_index_capacity" in self.model_fields_set:
            return self.route_index_capacity
        tokens = kv_capacity_tokens if kv_capacity_tokens is not None else self.route_kv_capacity_tokens
        if tokens is None:
            return self.route_index_capacity
        return max(1, math.ceil(tokens * BYTES_PER_TOKEN / self.route_chunk_bytes))

    def host_capacity_for(self) -> int:
        """Index entries (blocks) for one replica's host tier (RJ_ROUTE_HOST_TIER_TOKENS), beside its device's:
        as many blocks as the tier holds tokens, at the same bytes per token; 0: no host tier."""
        return math.ceil(self.route_host_tier_tokens * BYTES_PER_TOKEN / self.route_chunk_bytes)

    api_host = _addr_part("api_addr", 0)
    api_port = _addr_part("api_addr", 1)
    metrics_host = _addr_part("metrics_addr", 0)
    metrics_port = _addr_part("metrics_addr", 1)
    admin_host = _addr_part("admin_addr", 0)
    admin_port = _addr_part("admin_addr", 1)

    connect_timeout_s = _seconds("upstream_connect_timeout_ms")
    first_byte_timeout_s = _seconds("upstream_first_byte_timeout_ms")
    pool_idle_timeout_s = _seconds("upstream_pool_idle_timeout_ms")
    health_interval_s = _seconds("health_interval_ms")
    health_timeout_s = _seconds("health_timeout_ms")
    rank_probe_timeout_s = _seconds("upstream_rank_probe_timeout_ms")
    liveness_window_s = _seconds("liveness_window_ms")
    kv_events_silence_s = _seconds("kv_events_silence_ms")
    api_key_max_wait_s = _seconds("api_key_max_wait_ms")
    admission_idle_s = _seconds("admission_idle_ms")
    admission_max_wait_s = _seconds("admission_max_wait_ms")
    state_interval_s = _seconds("state_interval_ms")
    shutdown_drain_s = _seconds("shutdown_drain_ms")
    shutdown_grace_s = _seconds("shutdown_grace_ms")
    engine_load_interval_s = _seconds("engine_load_interval_ms")
    client_header_timeout_s = _seconds("client_header_timeout_ms")
    client_body_timeout_s = _seconds("client_body_timeout_ms")
    client_idle_timeout_s = _seconds("client_idle_timeout_ms")

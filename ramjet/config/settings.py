"""Every `RJ_*` variable: its field, type, default and per-value checks (docs/configuration.md).

Built only by `ramjet.config.load_settings`, which adds the checks across variables. The Rust
Ramjet's variables that are not ours (honoured, mapped, or accepted at their off value) are
declared in `rust.py`, and the values derived from the fields in `derived.py`; Settings
extends both.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, Field, NonNegativeInt, PositiveInt, SecretStr, ValidationInfo,
                      field_validator)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ramjet.config.derived import BYTES_PER_TOKEN, Derived
from ramjet.config.rust import RustCompat
from ramjet.config.values import FALSE_WORDS, TRUE_WORDS, ConfigError, is_loopback, normalise_url, parse_addr
from ramjet.routing.policies import BASES
from ramjet.routing.shortlist import DEFAULT_ABOVE as SHORTLIST_ABOVE

__all__ = ["BYTES_PER_TOKEN", "FALSE_WORDS", "MIB", "TRUE_WORDS", "ConfigError", "Settings"]

MIB = 1024 * 1024

Url = Annotated[str, AfterValidator(normalise_url)]


class Settings(RustCompat, Derived):
    """Every tunable of the balancer: field `foo_bar` is variable `RJ_FOO_BAR`. Build it with load_settings().

    The Rust Ramjet's variables that are not ours come first, from RustCompat (config/rust.py); what
    the values mean to their readers (seconds, listener parts, ...) is Derived (config/derived.py).
    """

    model_config = SettingsConfigDict(env_prefix="RJ_", frozen=True)

    # upstreams and topology (field order matters: a validator sees the fields above it in `info.data`)
    upstream: list[Url] = []
    upstream_dp_ranks: list[NonNegativeInt | None] | None = None
    upstream_dp_size: PositiveInt | Literal["auto"] | None = None
    topology_file: Path | None = None
    upstream_token: SecretStr | None = Field(None, repr=False)
    api_keys: list[str] = Field([], repr=False, exclude=True)

    # routing
    affinity: Literal["prefix", "load"] = "prefix"
    route_affinity_basis: str = "relative"  # one of ramjet.routing.policies.BASES
    route_alpha: float = Field(2.0, ge=0, allow_inf_nan=False)
    route_new_sessions: Literal["auto", "affinity", "balance"] = "auto"
    route_chunk_bytes: int = Field(2048, ge=64)
    route_max_prefix_bytes: int = Field(2 * MIB, ge=64, validate_default=True)
    route_max_overlap_blocks: PositiveInt = 32
    route_index_capacity: PositiveInt = 100_000
    route_kv_capacity_tokens: PositiveInt | None = None
    route_host_tier_tokens: NonNegativeInt = 0   # per replica, on the host tier (HiCache): a reload, not a prefill
    route_load_unit_bytes: PositiveInt = 32768
    route_max_load_units: PositiveInt = 8
    route_max_attempts: PositiveInt = 3
    route_shortlist_above: NonNegativeInt = SHORTLIST_ABOVE  # replicas; beyond: a shortlist (routing/shortlist.py)
    route_in_flight: bool = True  # a request holding the whole prompt of one in flight continues it (in_flight.py)
    route_idle_decode_units: float = Field(2.0, ge=0, le=64, allow_inf_nan=False)  # units.with_idle_decode; 0: off
    # overload admission: hold a request whose prefill would evict history in use (routing/admission.py)
    admission: bool = False
    admission_idle_ms: PositiveInt = 30_000       # a block untouched this long is no longer in use
    admission_max_wait_ms: PositiveInt = 60_000   # the longest a request is held; then it is sent anyway
    # session hints: the clients' own conversation keys (routing/hints.py, routing/homes.py)
    session_hints: bool = True
    session_header: str | None = None  # a request header naming the conversation, e.g. x-session-id; None: off

    # upstream connections
    upstream_connect_timeout_ms: PositiveInt = 2000
    # A cold 115K-token prefill queued behind other prefills on a busy H200 rank can take a
    # minute or more before its first token; a shorter limit would fail over (and redo) real work.
    upstream_first_byte_timeout_ms: PositiveInt = 120_000
    # Below the engines' 5 s keep-alive, so no request goes out on a socket the engine closed.
    upstream_pool_idle_timeout_ms: NonNegativeInt = 4000
    max_body_bytes: PositiveInt = 16 * MIB

    # client limits: what one client may cost (docs/security.md)
    client_max_connections: PositiveInt = 4096
    client_max_headers: PositiveInt = 100
    client_max_header_bytes: PositiveInt = 32 * 1024
    client_max_url_bytes: PositiveInt = 8 * 1024
    client_header_timeout_ms: PositiveInt = 10_000
    client_body_timeout_ms: PositiveInt = 60_000
    client_idle_timeout_ms: PositiveInt = 60_000
    api_key_max_in_flight: NonNegativeInt = 128  # per key (per client address without keys); 0: no cap
    api_key_max_queued: NonNegativeInt = 1024    # beyond the cap, waiting in the key's own queue; 0: 429 at once
    api_key_max_wait_ms: PositiveInt = 300_000   # longest wait in that queue before a 429
    max_json_depth: int = Field(64, ge=2, le=200)
    passthrough_routes: list[str] = ["/v1/models", "/v1/models/{id}"]
    pass_response_headers: list[str] = []

    # fencing on evidence from real requests (docs/operations.md)
    fence_after_failures: PositiveInt = 3
    fence_max_share: float = Field(0.5, ge=0, le=1)
    failover_budget_percent: float = Field(20.0, ge=0, le=100)

    # listeners, logs
    api_addr: str = "0.0.0.0:8000"
    metrics_addr: str | None = None
    route_journal: bool | Path | None = Field(None, union_mode="left_to_right")  # a true/false word, else a path
    state_file: Path | None = None  # what each replica holds, kept across restarts (ramjet.balancer.memory)
    state_interval_ms: PositiveInt = 30_000
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # shutdown and several processes (docs/operations.md)
    shutdown_drain_ms: NonNegativeInt = 5000    # /readyz answers 503 this long before listeners close
    shutdown_grace_ms: NonNegativeInt = 60_000  # then in-flight requests may finish for this long
    workers: PositiveInt = 1                    # balancer processes sharing RJ_API_ADDR (SO_REUSEPORT)

    # engine-reported load (ramjet.balancer.engine_load)
    engine_load: Literal["auto", "off"] = "auto"
    engine_load_interval_ms: PositiveInt = 1000

    # precise mode: route on the engines' own KV cache events (docs/design.md)
    kv_events: Literal["off", "zmq"] = "off"
    kv_events_endpoint: str | None = None         # a template (tcp://{host}:5557, + rank) or a list; None: discover
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_silence_ms: PositiveInt = 10_000
    # what one engine's streams may cost (balancer/precise/intake.py, kvevents/subscriber.py)
    kv_events_loop_share: float = Field(0.25, gt=0, le=1)  # of the event loop, for every stream's events together
    kv_events_max_rate: PositiveInt = 20_000       # events/s of one replica before its stream is shed
    kv_events_max_frame_bytes: int = Field(MIB, ge=1024)  # a bigger frame is refused unread (ZMQ_MAXMSGSIZE)
    kv_events_max_queued_bytes: int = Field(32 * MIB, ge=1024)  # per stream, in ZMQ's queue (RCVHWM = this / frame)
    kv_events_max_blocks: PositiveInt = 262_144    # per replica in the token index; beyond, its view is cleared
    kv_host_tier_credit: float = Field(0.9, ge=0, le=1)
    tokenizer: Path | None = Field(None, validate_default=True)

    # health
    health_interval_ms: PositiveInt = 5000
    health_timeout_ms: PositiveInt = 2000
    health_path: str = "/health"
    upstream_rank_probe: bool = False
    upstream_rank_probe_path: Literal["/generate", "/v1/completions"] = "/generate"
    upstream_rank_probe_timeout_ms: PositiveInt = 10_000
    liveness_window_ms: NonNegativeInt = 30_000
    unfence_after: PositiveInt = 1

    # operator API: loopback by default, because without a key anyone who reaches it may use it
    admin_addr: str | None = "127.0.0.1:9091"
    admin_keys: list[str] = Field([], repr=False, exclude=True, validate_default=True)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   **_others: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        """Only what load_settings hands over, so the mapping it was given is all there is (no .env, no secrets)."""
        return (init_settings,)

    # --- field validators: one rule each; a rule between two variables sits on the later one ---

    @field_validator("upstream", "api_keys", "admin_keys", "passthrough_routes", "pass_response_headers", mode="before")
    @classmethod
    def _v_comma_list(cls, v: Any) -> Any:
        # An empty upstream entry stays (and fails): it would shift RJ_UPSTREAM_DP_RANKS. An empty key is dropped.
        if isinstance(v, str):
            return [e.strip() for e in v.split(",")] if v.strip() else []
        return v

    @field_validator("api_keys", "admin_keys")
    @classmethod
    def _v_keys(cls, v: list[str]) -> list[str]:
        return [k for k in v if k]

    @field_validator("upstream_dp_ranks", mode="before")
    @classmethod
    def _v_ranks(cls, v: Any) -> Any:
        return [e.strip() or None for e in v.split(",")] if isinstance(v, str) else v  # empty entry: no pin

    @field_validator("upstream_dp_ranks")
    @classmethod
    def _v_ranks_aligned(cls, v: list[int | None] | None, info: ValidationInfo) -> list[int | None] | None:
        upstreams = info.data.get("upstream")  # absent when itself invalid: nothing to compare
        if v is not None and upstreams and len(v) != len(upstreams):
            raise ValueError(f"has {len(v)} entries but RJ_UPSTREAM has {len(upstreams)}; they are index-aligned "
                             "(use an empty entry for an upstream without a pin)")
        return v

    @field_validator("upstream_dp_size", mode="before")
    @classmethod
    def _v_dp_size(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.lower()
            if v != "auto" and not (v.isdigit() and int(v) >= 1):
                raise ValueError("expected a positive integer or 'auto'")
        return v

    @field_validator("upstream_token")
    @classmethod
    def _v_token(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not re.fullmatch(r"[^\s\x00-\x1f\x7f]+", v.get_secret_value()):
            raise ValueError("must be a non-empty token without whitespace or control characters")
        return v

    @field_validator("affinity", "route_affinity_basis", "route_new_sessions", "log_level", mode="before")
    @classmethod
    def _v_lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v

    @field_validator("route_affinity_basis")
    @classmethod
    def _v_basis(cls, v: str) -> str:
        if v not in BASES:
            *head, last = (repr(b) for b in BASES)
            raise ValueError(f"expected {', '.join(head)} or {last}")
        return v

    @field_validator("route_max_prefix_bytes")
    @classmethod
    def _v_prefix_holds_a_block(cls, v: int, info: ValidationInfo) -> int:
        chunk = info.data.get("route_chunk_bytes")
        if chunk is not None and v < chunk:
            raise ValueError(f"{v} is smaller than RJ_ROUTE_CHUNK_BYTES ({chunk}); expected at least one block")
        return v

    @field_validator("admin_addr", mode="before")
    @classmethod
    def _v_admin_off(cls, v: Any) -> Any:
        return None if isinstance(v, str) and (not v or v.lower() in FALSE_WORDS) else v

    @field_validator("api_addr", "metrics_addr", "admin_addr")
    @classmethod
    def _v_addr(cls, v: str | None) -> str | None:
        if v is None:
            return v
        host, port = parse_addr(v)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @field_validator("admin_keys")
    @classmethod
    def _v_admin_guarded(cls, v: list[str], info: ValidationInfo) -> list[str]:
        addr = info.data.get("admin_addr")
        if not v and addr is not None and not is_loopback(parse_addr(addr)[0]):
            raise ValueError(f"is empty but RJ_ADMIN_ADDR ({addr}) is not a loopback address, so anyone who reaches "
                             "it could drive the operator API; set RJ_ADMIN_KEYS or bind RJ_ADMIN_ADDR to 127.0.0.1")
        return v

    @field_validator("passthrough_routes")
    @classmethod
    def _v_routes(cls, v: list[str]) -> list[str]:
        for route in v:
            if not re.fullmatch(r"/v1(/([A-Za-z0-9_.-]+|\{[a-z_]+\}))+", route) or "/." in route:
                raise ValueError(f"{route!r} is not a route under /v1/: expected paths like /v1/models or "
                                 "/v1/models/{id} ({name} matches one path segment)")
        return v

    @field_validator("pass_response_headers")
    @classmethod
    def _v_header_names(cls, v: list[str]) -> list[str]:
        bad = [h for h in v if not re.fullmatch(r"[A-Za-z0-9-]+", h) or h.lower().startswith("x-ramjet-")]
        if bad:
            raise ValueError(f"{', '.join(bad)}: expected header names (x-ramjet-* are the balancer's own)")
        return [h.lower() for h in v]

    @field_validator("session_header")
    @classmethod
    def _v_session_header(cls, v: str | None) -> str | None:
        if v is not None and (not re.fullmatch(r"[A-Za-z0-9-]+", v) or v.lower().startswith("x-ramjet-")):
            raise ValueError("expected one header name such as x-session-id (x-ramjet-* are the balancer's own)")
        return v.lower() if v is not None else v

    @field_validator("kv_events_max_queued_bytes")
    @classmethod
    def _v_queue_holds_a_frame(cls, v: int, info: ValidationInfo) -> int:
        frame = info.data.get("kv_events_max_frame_bytes")
        if frame is not None and v < frame:
            raise ValueError(f"must hold at least one frame of RJ_KV_EVENTS_MAX_FRAME_BYTES ({frame})")
        return v

    @field_validator("kv_events", mode="before")
    @classmethod
    def _v_kv_events(cls, v: Any) -> Any:
        return "off" if isinstance(v, str) and v.lower() in FALSE_WORDS else v.lower() if isinstance(v, str) else v

    @field_validator("tokenizer")
    @classmethod
    def _v_tokenizer(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        if info.data.get("kv_events") == "zmq" and v is None:
            raise ValueError("is required with RJ_KV_EVENTS=zmq: precise routing tokenizes requests as the engine "
                             "does; point it at the model's tokenizer directory (tokenizer.json, tokenizer_config.json)")
        if v is not None and not (v / "tokenizer.json").is_file():
            raise ValueError(f"{v} has no tokenizer.json; expected a Hugging Face tokenizer or model directory")
        return v

    @field_validator("health_path")
    @classmethod
    def _v_path(cls, v: str) -> str:
        if not v.startswith("/") or any(c.isspace() for c in v):
            raise ValueError("expected a path starting with '/', e.g. /health or /v1/models")
        return v

    @field_validator("route_journal")
    @classmethod
    def _v_journal(cls, v: bool | Path | None) -> bool | Path | None:
        if isinstance(v, Path) and v.is_dir():
            raise ValueError("is a directory; expected true/false or a file path to append to")
        return v

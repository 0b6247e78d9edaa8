"""Settings from `RJ_*` environment variables, validated once at start-up.

`load_settings()` is the entry point: it reports every problem at once (unknown
`RJ_*` names, bad values, conflicting variables) in one `ConfigError`, because
an operator fixing a Compose file should not discover errors one restart at a
time. Variables are documented in docs/configuration.md.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

MIB = 1024 * 1024
BYTES_PER_TOKEN = 4  # canonical prompt bytes per token, roughly, for English text and code
TRUE_WORDS = frozenset({"true", "1", "on", "yes"})
FALSE_WORDS = frozenset({"false", "0", "off", "no"})
SECRET_VARS = frozenset({"RJ_UPSTREAM_TOKEN", "RJ_API_KEYS"})


class ConfigError(Exception):
    """Start-up configuration is unusable; the message names every offending variable."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


# --- value parsers (shared by the field validators and the conflict checks) ---

def _redact(url: str) -> str:
    """Hide URL credentials in messages: a URL's user:password part is a secret."""
    return re.sub(r"//[^/@]*@", "//***@", url)


def normalise_url(raw: str) -> str:
    """Engine base URL -> canonical form (lower-case scheme and host, no trailing slash).

    One canonical form per engine, because the engine identity (all ranks behind
    one process) is the URL. Credentials, queries and fragments are refused:
    the upstream token goes in RJ_UPSTREAM_TOKEN, never in a URL.
    """
    url = raw.strip().rstrip("/")
    expected = "expected http(s)://host[:port][/path]"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"{_redact(url)!r} is not a valid URL; {expected}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{_redact(url)!r} is not an http(s) URL; {expected}")
    if "@" in parts.netloc:
        raise ValueError(f"{_redact(url)!r} carries credentials; put the token in RJ_UPSTREAM_TOKEN")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ValueError(f"{_redact(url)!r} has a query or fragment; {expected}")
    netloc = parts.netloc.lower()
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{_redact(url)!r} has port {port} out of range; {expected}")
    return f"{parts.scheme.lower()}://{netloc}{parts.path.rstrip('/')}"


def parse_upstreams(raw: str) -> list[str]:
    """`RJ_UPSTREAM` comma list -> normalised URLs; empty entries are errors (they would shift DP_RANKS)."""
    if not raw.strip():
        return []
    out, errors = [], []
    for i, entry in enumerate(raw.split(",")):
        if not entry.strip():
            errors.append(f"entry {i} is empty")
            continue
        try:
            out.append(normalise_url(entry))
        except ValueError as exc:
            errors.append(f"entry {i}: {exc}")
    if errors:
        raise ValueError("; ".join(errors))
    return out


def parse_ranks(raw: str) -> list[int | None]:
    """`RJ_UPSTREAM_DP_RANKS` -> one rank per upstream; an empty entry means no pin."""
    out: list[int | None] = []
    for i, entry in enumerate(raw.split(",")):
        entry = entry.strip()
        if not entry:
            out.append(None)
        elif entry.isdigit():
            out.append(int(entry))
        else:
            raise ValueError(f"entry {i} ({entry!r}) is not a rank; expected an integer >= 0, or empty for no pin")
    return out


def parse_addr(raw: str) -> tuple[str, int]:
    """`host:port` or `[ipv6]:port` -> (host, port), host without brackets as servers want it."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\[\]\s]+):(\d+)", raw.strip())
    if not m:
        raise ValueError(f"{raw!r} is not host:port; expected e.g. 0.0.0.0:8000 or [::]:8000")
    host, port = (m[1], m[2]) if m[1] else (m[3], m[4])
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port {port} is out of range 1-65535")
    return host, int(port)


def _list_from_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


Ms = Annotated[int, Field(ge=1)]  # a duration in milliseconds


# --- environment source --------------------------------------------------------

_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("ramjet_environ", default=None)


class _EnvSource(EnvSettingsSource):
    """The ordinary env source, but reading the mapping given to load_settings (os.environ otherwise)."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        env = _ENVIRON.get()
        env = os.environ if env is None else env
        return {k: v for k, v in env.items() if k.startswith("RJ_") and v != ""}


@contextmanager
def _reading(environ: Mapping[str, str]) -> Iterator[None]:
    token = _ENVIRON.set(environ)
    try:
        yield
    finally:
        _ENVIRON.reset(token)


# --- settings ----------------------------------------------------------------------

class Settings(BaseSettings):
    """Every tunable of the balancer. Field `foo_bar` is read from `RJ_FOO_BAR`; an empty value means unset."""

    model_config = SettingsConfigDict(
        env_prefix="RJ_", case_sensitive=True, alias_generator=lambda name: "RJ_" + name.upper(),
        populate_by_name=True, env_ignore_empty=True, frozen=True, env_file=None,
    )

    # upstreams and topology
    upstream: str = ""
    upstream_dp_ranks: Annotated[list[int | None] | None, NoDecode] = None
    upstream_dp_size: int | Literal["auto"] | None = None
    topology_file: Path | None = None
    upstream_token: SecretStr | None = Field(None, repr=False)
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, repr=False)

    # routing
    affinity: Literal["prefix", "load"] = "prefix"
    route_affinity_basis: Literal["absolute", "marginal", "relative", "ttft"] = "relative"
    route_alpha: float = Field(4.0, ge=0, allow_inf_nan=False)
    route_new_sessions: Literal["affinity", "balance"] = "affinity"
    route_chunk_bytes: int = Field(2048, ge=64)
    route_max_prefix_bytes: int = Field(2 * MIB, ge=64)
    route_max_overlap_blocks: int = Field(32, ge=1)
    route_index_capacity: int = Field(100_000, ge=1)
    route_kv_capacity_tokens: int | None = Field(None, ge=1)
    route_load_unit_bytes: int = Field(32768, ge=1)
    route_max_load_units: int = Field(8, ge=1)
    route_max_attempts: int = Field(3, ge=1)

    # upstream connections
    upstream_connect_timeout_ms: Ms = 2000
    # A cold 115K-token prefill queued behind other prefills on a busy H200 rank can take a
    # minute or more before its first token; a shorter limit would fail over (and redo) real work.
    upstream_first_byte_timeout_ms: Ms = 120_000
    # Below the engines' 5 s keep-alive, so no request goes out on a socket the engine closed.
    upstream_pool_idle_timeout_ms: int = Field(4000, ge=0)
    max_body_bytes: int = Field(16 * MIB, ge=1)

    # listeners, logs
    api_addr: str = "0.0.0.0:8000"
    metrics_addr: str | None = None
    route_journal: str | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # health (issue 4)
    health_interval_ms: Ms = 5000
    health_timeout_ms: Ms = 2000
    health_path: str = "/health"
    upstream_rank_probe: bool = False
    upstream_rank_probe_path: Literal["/generate", "/v1/completions"] = "/generate"
    upstream_rank_probe_timeout_ms: Ms = 10_000
    liveness_window_ms: int = Field(30_000, ge=0)
    unfence_after: int = Field(1, ge=1)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        # No .env file and no secrets directory: only what the process was given.
        return init_settings, _EnvSource(settings_cls)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """Validate `environ` (not os.environ); raises pydantic's ValidationError. Prefer load_settings()."""
        with _reading(environ):
            return cls()

    # --- field validators ---

    @field_validator("upstream", mode="before")
    @classmethod
    def _v_upstream(cls, v: Any) -> Any:
        return ",".join(parse_upstreams(v)) if isinstance(v, str) else v

    @field_validator("upstream_dp_ranks", mode="before")
    @classmethod
    def _v_ranks(cls, v: Any) -> Any:
        return parse_ranks(v) if isinstance(v, str) else v

    @field_validator("upstream_dp_ranks")
    @classmethod
    def _v_ranks_nonneg(cls, v: list[int | None] | None) -> list[int | None] | None:
        if v is not None and any(r is not None and r < 0 for r in v):
            raise ValueError("ranks must be integers >= 0")
        return v

    @field_validator("upstream_dp_size", mode="before")
    @classmethod
    def _v_dp_size(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip().lower()
            if v == "auto":
                return v
            if not v.isdigit() or int(v) < 1:
                raise ValueError("expected a positive integer or 'auto'")
            return int(v)
        return v

    @field_validator("api_keys", mode="before")
    @classmethod
    def _v_keys(cls, v: Any) -> Any:
        return _list_from_csv(v)

    @field_validator("upstream_token", mode="before")
    @classmethod
    def _v_token(cls, v: Any) -> Any:
        raw = v.get_secret_value() if isinstance(v, SecretStr) else v
        if isinstance(raw, str) and (not raw.strip() or any(c.isspace() or ord(c) < 32 for c in raw)):
            raise ValueError("must be a non-empty token without whitespace or control characters")
        return v

    @field_validator("affinity", "route_affinity_basis", "log_level", mode="before")
    @classmethod
    def _v_lower(cls, v: Any) -> Any:
        return _lower(v)

    @field_validator("upstream_rank_probe", mode="before")
    @classmethod
    def _v_onoff(cls, v: Any) -> Any:
        if isinstance(v, str):
            word = v.strip().lower()
            if word in TRUE_WORDS | FALSE_WORDS:
                return word in TRUE_WORDS
            raise ValueError("expected on/off (or true/false, 1/0)")
        return v

    @field_validator("api_addr", "metrics_addr")
    @classmethod
    def _v_addr(cls, v: str | None) -> str | None:
        if v is None:
            return v
        host, port = parse_addr(v)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @field_validator("health_path")
    @classmethod
    def _v_path(cls, v: str) -> str:
        v = v.strip()
        if not v.startswith("/") or any(c.isspace() for c in v):
            raise ValueError("expected a path starting with '/', e.g. /health or /v1/models")
        return v

    @field_validator("route_journal")
    @classmethod
    def _v_journal(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = v.strip()
        if v.lower() not in TRUE_WORDS | FALSE_WORDS and Path(v).is_dir():
            raise ValueError("is a directory; expected true/false or a file path to append to")
        return v

    @model_validator(mode="after")
    def _v_conflicts(self) -> Settings:
        problems = conflicts(
            present={name for name, value in (("RJ_UPSTREAM", self.upstream), ("RJ_UPSTREAM_DP_RANKS", self.upstream_dp_ranks),
                                              ("RJ_UPSTREAM_DP_SIZE", self.upstream_dp_size),
                                              ("RJ_TOPOLOGY_FILE", self.topology_file)) if value not in (None, "")},
            n_upstreams=len(self.upstreams),
            n_ranks=None if self.upstream_dp_ranks is None else len(self.upstream_dp_ranks),
            chunk=self.route_chunk_bytes, max_prefix=self.route_max_prefix_bytes)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # --- derived values ---

    @property
    def upstreams(self) -> list[str]:
        """RJ_UPSTREAM as normalised URLs, in order (duplicates kept: DP_RANKS lists one URL per rank)."""
        return self.upstream.split(",") if self.upstream else []

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

    @property
    def journal_target(self) -> None | Literal["stdout"] | Path:
        """RJ_ROUTE_JOURNAL: off (None), JSON lines on stdout, or a file to append to."""
        if self.route_journal is None or self.route_journal.lower() in FALSE_WORDS:
            return None
        if self.route_journal.lower() in TRUE_WORDS:
            return "stdout"
        return Path(self.route_journal)

    @property
    def api_host(self) -> str:
        return parse_addr(self.api_addr)[0]

    @property
    def api_port(self) -> int:
        return parse_addr(self.api_addr)[1]

    @property
    def metrics_host(self) -> str | None:
        return parse_addr(self.metrics_addr)[0] if self.metrics_addr else None

    @property
    def metrics_port(self) -> int | None:
        return parse_addr(self.metrics_addr)[1] if self.metrics_addr else None

    @property
    def connect_timeout_s(self) -> float:
        return self.upstream_connect_timeout_ms / 1000

    @property
    def first_byte_timeout_s(self) -> float:
        return self.upstream_first_byte_timeout_ms / 1000

    @property
    def pool_idle_timeout_s(self) -> float:
        return self.upstream_pool_idle_timeout_ms / 1000

    @property
    def health_interval_s(self) -> float:
        return self.health_interval_ms / 1000

    @property
    def health_timeout_s(self) -> float:
        return self.health_timeout_ms / 1000

    @property
    def rank_probe_timeout_s(self) -> float:
        return self.upstream_rank_probe_timeout_ms / 1000

    @property
    def liveness_window_s(self) -> float:
        return self.liveness_window_ms / 1000


KNOWN_VARS: tuple[str, ...] = tuple(f.alias for f in Settings.model_fields.values())  # type: ignore[misc]
_FIELD_BY_VAR = {f.alias: name for name, f in Settings.model_fields.items()}


# --- cross-variable rules ------------------------------------------------------------

def conflicts(present: set[str], n_upstreams: int | None, n_ranks: int | None,
              chunk: int | None, max_prefix: int | None) -> list[str]:
    """Rules between variables. None means unknown (unset or itself invalid): that rule is skipped."""
    out = []
    if {"RJ_UPSTREAM_DP_RANKS", "RJ_UPSTREAM_DP_SIZE"} <= present:
        out.append("RJ_UPSTREAM_DP_RANKS and RJ_UPSTREAM_DP_SIZE are both set; set one "
                   "(explicit ranks per upstream, or N/auto ranks for every upstream)")
    if "RJ_TOPOLOGY_FILE" in present:
        for name in ("RJ_UPSTREAM", "RJ_UPSTREAM_DP_RANKS", "RJ_UPSTREAM_DP_SIZE"):
            if name in present:
                out.append(f"{name} is set together with RJ_TOPOLOGY_FILE, which owns the upstream list; set one")
    elif "RJ_UPSTREAM" not in present:
        out.append("RJ_UPSTREAM: no upstream configured; set RJ_UPSTREAM (engine URLs) or RJ_TOPOLOGY_FILE")
    if "RJ_UPSTREAM_DP_RANKS" in present and n_upstreams is not None and n_ranks is not None \
            and "RJ_UPSTREAM" in present and n_upstreams != n_ranks:
        out.append(f"RJ_UPSTREAM_DP_RANKS has {n_ranks} entries but RJ_UPSTREAM has {n_upstreams}; "
                   "they are index-aligned (use an empty entry for an upstream without a pin)")
    if chunk is not None and max_prefix is not None and max_prefix < chunk:
        out.append(f"RJ_ROUTE_MAX_PREFIX_BYTES ({max_prefix}) is smaller than RJ_ROUTE_CHUNK_BYTES ({chunk}); "
                   "expected at least one block")
    return out


def _raw_conflicts(env: Mapping[str, str], bad: set[str]) -> list[str]:
    """The same rules on raw values, so conflicts are reported even when other values are invalid."""
    def get(name: str) -> str | None:
        v = env.get(name)
        return None if v is None or not v.strip() else v

    def parsed(name: str, parse: Any, default: Any = None) -> Any:
        v = get(name)
        if v is None:
            return default
        if name in bad:
            return None
        try:
            return parse(v)
        except ValueError:
            return None

    ups = parsed("RJ_UPSTREAM", parse_upstreams, [])
    ranks = parsed("RJ_UPSTREAM_DP_RANKS", parse_ranks)
    return conflicts(
        present={n for n in ("RJ_UPSTREAM", "RJ_UPSTREAM_DP_RANKS", "RJ_UPSTREAM_DP_SIZE", "RJ_TOPOLOGY_FILE") if get(n)},
        n_upstreams=None if ups is None else len(ups), n_ranks=None if ranks is None else len(ranks),
        chunk=parsed("RJ_ROUTE_CHUNK_BYTES", int, 2048), max_prefix=parsed("RJ_ROUTE_MAX_PREFIX_BYTES", int, 2 * MIB))


def _describe(var: str, value: str | None, msg: str) -> str:
    msg = msg.removeprefix("Value error, ")
    if var in SECRET_VARS or value is None:
        return f"{var}: {msg}"
    return f"{var}={_redact(value)!r}: {msg}"


def _unknown(env: Mapping[str, str]) -> list[str]:
    out = []
    for name in sorted(k for k in env if k.upper().startswith("RJ_") and k not in KNOWN_VARS):
        close = difflib.get_close_matches(name.upper(), KNOWN_VARS, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        out.append(f"{name}: unknown variable (a typo would silently change behaviour){hint}")
    return out


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from `environ` (default os.environ); raises one ConfigError listing every problem."""
    env = dict(os.environ if environ is None else environ)
    problems = _unknown(env)
    settings = None
    try:
        settings = Settings.from_environ(env)
    except ValidationError as exc:
        bad, model_errors = set(), []
        for err in exc.errors():
            if err["loc"]:
                var = str(err["loc"][0])
                bad.add(var)
                problems.append(_describe(var, env.get(var), err["msg"]))
            else:
                model_errors.append(err["msg"].removeprefix("Value error, "))
        cross = _raw_conflicts(env, bad)
        problems += cross or model_errors
    if problems:
        raise ConfigError(problems)
    assert settings is not None
    return settings

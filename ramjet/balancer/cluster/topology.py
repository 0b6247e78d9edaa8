"""Upstream list -> replicas: one replica per (engine URL, DP rank) the balancer may pin to.

Sources, exactly one of: RJ_UPSTREAM with RJ_UPSTREAM_DP_RANKS (Rust Ramjet style:
the same URL listed once per rank), RJ_UPSTREAM with RJ_UPSTREAM_DP_SIZE (N or
`auto`), or RJ_TOPOLOGY_FILE (named nodes). All problems are reported in one
ConfigError, like the rest of the configuration.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ramjet.balancer.engines.client import EngineClient
from ramjet.balancer.engines.upstream import Upstream
from ramjet.config import ConfigError, Settings, normalise_url

DISCOVERY_TIMEOUT_S = 10.0  # /get_server_info goes through the scheduler; a loaded engine answers slowly


@dataclass(frozen=True)
class Replica:
    """One routing target: an engine, pinned to `dp_rank` (None: the engine picks the rank).

    `engine` is the normalised engine URL; every rank of one engine shares it, so a
    refused connection can down them all and failover can prefer another engine.
    `node` is an operator-facing name (never the URL), safe for metrics and /health.
    """

    ordinal: int
    url: str
    dp_rank: int | None
    node: str
    engine: str
    model: str | None = None
    kv_capacity_tokens: int | None = None

    @property
    def labels(self) -> tuple[str, str, str]:
        """(upstream, node, rank) metric label values."""
        return str(self.ordinal), self.node, "" if self.dp_rank is None else str(self.dp_rank)


# --- topology file schema ----------------------------------------------------

class _ReplicaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    url: str
    model: str | None = Field(None, min_length=1)
    dp_ranks: Any = None  # list of ranks | "auto" | N; validated below for clear messages
    dp_size: Any = None  # optional N | "auto": checks an explicit dp_ranks list against the engine's size
    kv_capacity_tokens: int | None = Field(None, ge=1)

    @field_validator("url")
    @classmethod
    def _v_url(cls, v: str) -> str:
        return normalise_url(v)

    @field_validator("dp_ranks")
    @classmethod
    def _v_ranks(cls, v: Any) -> Any:
        if v is None or v == "auto" or _is_int(v, 1):
            return v
        if isinstance(v, list) and v and all(_is_int(r, 0) for r in v):
            if len(set(v)) != len(v):
                raise ValueError("dp_ranks lists a rank twice")
            return v
        raise ValueError('expected a non-empty list of ranks (integers >= 0), "auto", or a dp size N >= 1')

    @field_validator("dp_size")
    @classmethod
    def _v_size(cls, v: Any) -> Any:
        if v is None or v == "auto" or _is_int(v, 1):
            return v
        raise ValueError('expected a dp size N >= 1 or "auto"')


class _NodeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1)
    replicas: list[_ReplicaSpec] = Field(min_length=1)


class _TopologySpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    nodes: list[_NodeSpec] = Field(min_length=1)


def _is_int(v: Any, minimum: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _json_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


# --- expansion ----------------------------------------------------------------------

@dataclass
class _Entry:
    """One configured engine entry before rank expansion."""

    where: str  # names it in error messages (never the URL)
    node: str
    url: str
    ranks: list[int | None] | None  # None: all ranks 0..dp_size-1
    dp_size: int | Literal["auto"] | None
    model: str | None = None
    kv_capacity_tokens: int | None = None


def _entries_from_env(settings: Settings) -> list[_Entry]:
    urls = settings.upstreams
    names: dict[str, str] = {}
    for url in urls:
        names.setdefault(url, f"engine{len(names)}")
    ranks = settings.upstream_dp_ranks
    if ranks is not None and len(ranks) != len(urls):
        raise ConfigError(f"RJ_UPSTREAM_DP_RANKS has {len(ranks)} entries but RJ_UPSTREAM has {len(urls)}")
    entries = []
    for i, url in enumerate(urls):
        where = f"RJ_UPSTREAM entry {i} ({names[url]})"
        if ranks is not None:
            entries.append(_Entry(where, names[url], url, [ranks[i]], None))
        elif settings.upstream_dp_size is not None:
            entries.append(_Entry(where, names[url], url, None, settings.upstream_dp_size))
        else:
            entries.append(_Entry(where, names[url], url, [None], None))
    return entries


def load_topology_file(path: Path) -> list[_Entry]:
    """Parse RJ_TOPOLOGY_FILE; errors carry the JSON path of the offending field."""
    try:
        data = orjson.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ConfigError(f"RJ_TOPOLOGY_FILE={str(path)!r}: cannot read: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"RJ_TOPOLOGY_FILE={str(path)!r}: not valid JSON: {exc}") from None
    try:
        spec = _TopologySpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([f"RJ_TOPOLOGY_FILE={str(path)!r}: {_json_path(e['loc'])}: "
                           f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors()]) from None
    entries, seen = [], set()
    problems = []
    for n, node in enumerate(spec.nodes):
        if node.name in seen:
            problems.append(f"RJ_TOPOLOGY_FILE: nodes[{n}].name: node name {node.name!r} is used twice")
        seen.add(node.name)
        for r, rep in enumerate(node.replicas):
            where = f"RJ_TOPOLOGY_FILE nodes[{n}].replicas[{r}] (node {node.name})"
            if isinstance(rep.dp_ranks, list):
                ranks, size = rep.dp_ranks, rep.dp_size
            elif rep.dp_ranks is not None:
                ranks, size = None, rep.dp_ranks
                if rep.dp_size is not None and rep.dp_size != rep.dp_ranks:
                    problems.append(f"{where}: dp_ranks {rep.dp_ranks!r} and dp_size {rep.dp_size!r} disagree")
            else:
                ranks, size = (None if rep.dp_size is not None else [None]), rep.dp_size
            entries.append(_Entry(where, node.name, rep.url, ranks, size, rep.model, rep.kv_capacity_tokens))
    if problems:
        raise ConfigError(problems)
    return entries


async def _discover(entries: list[_Entry], settings: Settings) -> list[str]:
    """Replace dp_size 'auto' by the engine's answer, one request per distinct URL, all concurrently."""
    urls = list(dict.fromkeys(e.url for e in entries if e.dp_size == "auto"))
    if not urls:
        return []
    token = settings.upstream_token.get_secret_value() if settings.upstream_token else None
    upstream = Upstream(settings.connect_timeout_s, DISCOVERY_TIMEOUT_S, 0, token)
    client = EngineClient(upstream, DISCOVERY_TIMEOUT_S)
    try:
        results = await asyncio.gather(*(client.dp_size(u) for u in urls), return_exceptions=True)
    finally:
        await upstream.aclose()
    found = dict(zip(urls, results))
    problems = []
    for e in entries:
        if e.dp_size != "auto":
            continue
        res = found[e.url]
        if isinstance(res, BaseException):
            if not isinstance(res, ValueError):
                raise res
            problems.append(f"{e.where}: dp size 'auto': cannot read dp_size from the engine: {res}")
        else:
            e.dp_size = res
    return problems


async def build_replicas(settings: Settings) -> list[Replica]:
    """Expand the configured engines into replicas with ordinals 0..n-1; raises ConfigError.

    dp size 1 means one replica without a pin (pinning a single-rank engine gains
    nothing). Ranks outside [0, dp_size) are refused: older SGLang crashes on them.
    """
    if settings.topology_file is not None:
        entries = load_topology_file(settings.topology_file)
    else:
        entries = _entries_from_env(settings)
    if not entries:
        raise ConfigError("RJ_UPSTREAM: no upstream configured; set RJ_UPSTREAM or RJ_TOPOLOGY_FILE")
    problems = await _discover(entries, settings)

    replicas: list[Replica] = []
    seen: dict[tuple[str, int | None], str] = {}
    for e in entries:
        if e.dp_size == "auto":
            continue  # discovery failed; already reported
        size = e.dp_size
        ranks = e.ranks if e.ranks is not None else (list(range(size)) if size and size > 1 else [None])
        for rank in ranks:
            if rank is not None and size is not None and not 0 <= rank < size:
                problems.append(f"{e.where}: rank {rank} is outside [0, {size}) for an engine with dp size {size}")
                continue
            if (e.url, rank) in seen:
                what = "without a rank pin" if rank is None else f"rank {rank}"
                problems.append(f"{e.where}: the same engine {what} is already listed at {seen[e.url, rank]}")
                continue
            seen[e.url, rank] = e.where
            replicas.append(Replica(len(replicas), e.url, rank, e.node, e.url, e.model, e.kv_capacity_tokens))
    if problems:
        raise ConfigError(problems)
    return replicas

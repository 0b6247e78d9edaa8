"""Settings from `RJ_*` environment variables, validated once at start-up.

`load_settings()` is the entry point. It reports every problem at once (unknown
`RJ_*` names, bad values, conflicting variables) in one ConfigError, because an
operator fixing a Compose file should not discover errors one restart at a
time. The variables themselves are declared in `settings.py` (the Rust Ramjet's that are not
ours in `rust.py`) and documented in docs/configuration.md.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Collection, Mapping

from pydantic import ValidationError

from ramjet.config.rust import rust_combinations
from ramjet.config.settings import Settings
from ramjet.config.values import FALSE_WORDS, TRUE_WORDS, ConfigError, normalise_url, redact

PREFIX: str = Settings.model_config["env_prefix"]
KNOWN_VARS: tuple[str, ...] = tuple(PREFIX + name.upper() for name in Settings.model_fields)
SECRET_VARS = frozenset(PREFIX + name.upper() for name, f in Settings.model_fields.items() if not f.repr)  # not shown
_EMPTY_MEANS_OFF = frozenset({"RJ_ADMIN_ADDR"})  # elsewhere an empty value means unset: the default applies


def _conflicts(given: Collection[str]) -> list[str]:
    """Rules on which variables are set, whatever their values, so a bad value does not hide a conflict."""
    out = []
    if {"RJ_UPSTREAM_DP_RANKS", "RJ_UPSTREAM_DP_SIZE"} <= set(given):
        out.append("RJ_UPSTREAM_DP_RANKS and RJ_UPSTREAM_DP_SIZE are both set; set one "
                   "(explicit ranks per upstream, or N/auto ranks for every upstream)")
    if "RJ_TOPOLOGY_FILE" in given:
        out += [f"{name} is set together with RJ_TOPOLOGY_FILE, which owns the upstream list; set one"
                for name in ("RJ_UPSTREAM", "RJ_UPSTREAM_DP_RANKS", "RJ_UPSTREAM_DP_SIZE") if name in given]
    elif "RJ_UPSTREAM" not in given:
        out.append("RJ_UPSTREAM: no upstream configured; set RJ_UPSTREAM (engine URLs) or RJ_TOPOLOGY_FILE")
    return out


def _combinations(s: Settings) -> list[str]:
    """Rules on values that only hold together."""
    out = []
    if s.workers > 1 and s.kv_events != "zmq":
        out.append(f"RJ_WORKERS={s.workers} needs RJ_KV_EVENTS=zmq: without the engines' KV events each worker knows "
                   "only the turns it forwarded, so a session's turns, spread over the workers by the kernel, would "
                   "split across ranks and pay their prefill again; one worker is enough for a single server "
                   "(docs/operations.md, \"Several worker processes\")")
    if s.admission and s.affinity == "load":
        out.append("RJ_ADMISSION=on needs RJ_AFFINITY=prefix: it keeps the prefixes the caches hold, which a "
                   "load-only policy does not track")
    return out + rust_combinations(s)


def _unknown(env: Mapping[str, str]) -> list[str]:
    out = []
    for name in sorted(k for k in env if k.upper().startswith(PREFIX) and k not in KNOWN_VARS):
        close = difflib.get_close_matches(name.upper(), KNOWN_VARS, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        out.append(f"{name}: unknown variable (a typo would silently change behaviour){hint}")
    return out


def _invalid(exc: ValidationError, given: Mapping[str, str]) -> list[str]:
    """One line per variable, naming it and its value (secrets never, URL credentials redacted)."""
    messages: dict[str, list[str]] = {}
    for err in exc.errors():
        loc = err["loc"]
        msg = err["msg"].removeprefix("Value error, ")
        if len(loc) > 1 and isinstance(loc[1], int):
            msg = f"entry {loc[1]}: {msg}"  # an item of a comma list
        messages.setdefault(PREFIX + str(loc[0]).upper() if loc else "", []).append(msg)
    out = []
    for var, msgs in messages.items():
        value = given.get(var)
        name = var if var in SECRET_VARS or value is None else f"{var}={redact(value)!r}"
        out.append(f"{name}: {'; '.join(msgs)}" if var else "; ".join(msgs))
    return out


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from `environ` (default os.environ) and nothing else; raises one ConfigError listing every problem.

    Surrounding whitespace is ignored and an empty value means unset, so `RJ_X=` in a Compose file
    is the same as leaving it out (RJ_ADMIN_ADDR excepted: empty turns the admin listener off).
    """
    env = os.environ if environ is None else environ
    given = {var: env[var].strip() for var in KNOWN_VARS if var in env}
    given = {var: v for var, v in given.items() if v or var in _EMPTY_MEANS_OFF}
    problems = _unknown(env)
    settings = None
    try:
        settings = Settings(**{var.removeprefix(PREFIX).lower(): v for var, v in given.items()})
    except ValidationError as exc:
        problems += _invalid(exc, given)
    problems += _conflicts(given)
    if settings is not None:
        problems += _combinations(settings)
    if problems:
        raise ConfigError(problems)
    assert settings is not None
    return settings


__all__ = ["FALSE_WORDS", "KNOWN_VARS", "PREFIX", "SECRET_VARS", "TRUE_WORDS", "ConfigError", "Settings", "load_settings",
           "normalise_url"]

"""`--placements relative,load,relative:alpha=2,cap=16`: which policies and settings to replay.

A placement is a policy name, optionally followed by `:key=value` settings; further
`key=value` items after a comma belong to the same placement, a bare name starts the next
one. Settings override the recording's own (the journal's header), so `relative` alone
replays the recording's settings under the relative basis. Parsing is strict: an unknown
policy, key or value is an error naming what is accepted, because a typo that silently
replayed the defaults would rank the wrong thing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ramjet.routing.policies import POLICY_NAMES
from ramjet.routing.policy import Params

NEW_SESSIONS = ("affinity", "balance")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError("must be an integer >= 1")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError("must be a finite number >= 0")
    return value


def _new_sessions(text: str) -> str:
    if text not in NEW_SESSIONS:
        raise ValueError(f"must be one of {', '.join(NEW_SESSIONS)}")
    return text


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise ValueError("must be on or off")
    return text == "on"


# key -> (parser, Params field or None for a router setting, what it is)
KEYS = {
    "alpha": (_non_negative, "alpha", "points per load unit (RJ_ROUTE_ALPHA)"),
    "cap": (_positive_int, "cap_blocks", "most credit an overlap earns, in blocks (RJ_ROUTE_MAX_OVERLAP_BLOCKS)"),
    "load_unit_bytes": (_positive_int, "load_unit_bytes", "uncached bytes per load unit (RJ_ROUTE_LOAD_UNIT_BYTES)"),
    "max_load_units": (_positive_int, "max_load_units", "most load units one request holds"),
    "balance": (_non_negative, "balance", "points per unit of demand share, new sessions only"),
    "new_sessions": (_new_sessions, None, "affinity or balance (RJ_ROUTE_NEW_SESSIONS)"),
    "index_capacity": (_positive_int, None, "blocks the index remembers per replica (RJ_ROUTE_INDEX_CAPACITY)"),
    "hints": (_on_off, None, "on or off: use the journal's hashed session keys (RJ_SESSION_HINTS)"),
    "in_flight": (_on_off, None, "on or off: a request holding a whole prompt in flight continues it (RJ_ROUTE_IN_FLIGHT)"),
}


class PlacementError(ValueError):
    """A --placements value that cannot be parsed; the message says what is accepted."""


@dataclass(frozen=True)
class Placement:
    label: str                       # as the user wrote it, for the report
    policy: str                      # a name in routing.policies.POLICY_NAMES
    settings: tuple[tuple[str, object], ...] = ()  # (key, parsed value), in the order given

    def params(self, base: Params) -> Params:
        """The recording's Params with this placement's overrides."""
        return replace(base, **{KEYS[k][1]: v for k, v in self.settings if KEYS[k][1] is not None})

    def new_sessions(self, base: str) -> str:
        return dict(self.settings).get("new_sessions", base)

    def session_hints(self, base: bool) -> bool:
        return dict(self.settings).get("hints", base)

    def in_flight(self, base: bool) -> bool:
        return dict(self.settings).get("in_flight", base)

    def index_capacities(self, base: list[int]) -> list[int]:
        capacity = dict(self.settings).get("index_capacity")
        return list(base) if capacity is None else [capacity] * len(base)


def parse_placements(text: str) -> list[Placement]:
    """Parse a --placements value; raises PlacementError."""
    if not text.strip():
        raise PlacementError("no placement given")
    groups: list[list[str]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise PlacementError(f"empty item in {text!r}")
        if "=" in item.partition(":")[0]:
            if not groups:
                raise PlacementError(f"{item!r} comes before any policy name")
            groups[-1].append(item)
        else:
            name, _, first = item.partition(":")
            groups.append([name, *([first] if first else [])])
    return [_placement(group) for group in groups]


def _placement(group: list[str]) -> Placement:
    name, items = group[0], group[1:]
    if name not in POLICY_NAMES:
        raise PlacementError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
    settings: dict[str, object] = {}
    given: list[str] = []
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise PlacementError(f"{name}: expected key=value, got {item!r}")
        if key not in KEYS:
            known = "; ".join(f"{k}: {what}" for k, (_, _, what) in KEYS.items())
            raise PlacementError(f"{name}: unknown setting {key!r}; known settings are {known}")
        if key in settings:
            raise PlacementError(f"{name}: {key} given twice")
        try:
            settings[key] = KEYS[key][0](value)
        except ValueError as e:
            raise PlacementError(f"{name}: {key}={value}: {key} {e}") from None
        given.append(f"{key}={value}")
    label = name + (":" + ",".join(given) if given else "")
    return Placement(label, name, tuple(settings.items()))

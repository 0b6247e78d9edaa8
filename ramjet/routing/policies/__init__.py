"""The registry of routing policies: the one list of names that config, bench and plots read.

A policy is chosen by name (RJ_ROUTE_AFFINITY_BASIS, or `load` with
RJ_AFFINITY=load); `new_sessions` is not chosen by name but applied by the
router to new conversations (RJ_ROUTE_NEW_SESSIONS).
"""

from __future__ import annotations

import sys

from ramjet.routing.policies.absolute import Absolute
from ramjet.routing.policies.load import LoadOnly
from ramjet.routing.policies.marginal import Marginal
from ramjet.routing.policies.new_sessions import NewSessions
from ramjet.routing.policies.relative import Relative
from ramjet.routing.policies.ttft import Ttft
from ramjet.routing.policy import Params, Policy

_BY_NAME: dict[str, type[Policy]] = {p.name: p for p in (Relative, Absolute, Marginal, Ttft, LoadOnly)}

BASES: tuple[str, ...] = tuple(name for name, p in _BY_NAME.items() if p.reads_overlap)  # "relative" first
POLICY_NAMES: tuple[str, ...] = tuple(_BY_NAME)  # BASES, then "load"


def make_policy(name: str, params: Params) -> Policy:
    """The policy called `name`; raises ValueError naming the known ones."""
    try:
        return _BY_NAME[name](params)
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; expected one of {', '.join(POLICY_NAMES)}") from None


def describe(name: str) -> str:
    """The policy's rule (its module's docstring) on one line, for explanations."""
    cls = NewSessions if name == NewSessions.name else _BY_NAME[name]
    return " ".join((sys.modules[cls.__module__].__doc__ or "").split())


__all__ = ["BASES", "POLICY_NAMES", "NewSessions", "describe", "make_policy"]

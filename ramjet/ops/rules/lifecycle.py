"""The rules for stopping: Docker, or the kubelet, must wait for the balancer's drain and grace, and for the engine.

On SIGTERM the balancer answers /readyz with 503 and keeps serving for RJ_SHUTDOWN_DRAIN_MS, then closes
its listeners and lets requests in flight finish for up to RJ_SHUTDOWN_GRACE_MS, then cancels what is
left (waiting up to 5 s for them) and saves its state file (docs/operations.md, "Shutdown and rolling
upgrades"). `docker compose stop`, `down` and `up -d` send SIGTERM and SIGKILL `stop_grace_period` later
(10 s by default); the kubelet waits `terminationGracePeriodSeconds` (30 by default). Either default
would cut every stream still running. The engine gets 120 s, as in the Rust Ramjet's bundle.
"""

from __future__ import annotations

import re

from ramjet.config import Settings
from ramjet.ops.manifests import dig
from ramjet.ops.rules.cluster import Cluster
from ramjet.ops.rules.deployment import Deployment
from ramjet.ops.rules.registry import Verdict, k8s_rule, rule

COMPOSE_DEFAULT_STOP_S = 10.0
KUBERNETES_DEFAULT_GRACE_S = 30
# After the grace the balancer cancels what still runs and waits up to 5 s for those requests to be aborted
# upstream (ramjet/balancer/server/serve.py, CANCEL_WAIT_S), then saves its state file: leave it 10 s for both.
STOP_MARGIN_S = 10.0
# The engine's stop_grace_period in the Rust Ramjet's bundle: on SIGTERM SGLang stops eight scheduler processes,
# the detokenizer and the tokenizer workers, which Compose's 10 s default would SIGKILL part-way.
ENGINE_STOP_S = 120.0
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|m|s|us|µs|ns)")


def compose_duration(text: str) -> float | None:
    """Seconds in a Compose duration (Go's syntax: `75s`, `1m15s`, `1.5m`, `500ms`), or None if unreadable."""
    text = text.strip()
    if not text or _PART.sub("", text):
        return None
    return sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))


def stop_needs_s(s: Settings) -> float:
    """Seconds from SIGTERM until the balancer has drained, let requests finish, cancelled the rest and saved."""
    return (s.shutdown_drain_ms + s.shutdown_grace_ms) / 1000 + STOP_MARGIN_S


def _phases(s: Settings) -> str:
    return (f"RJ_SHUTDOWN_DRAIN_MS {s.shutdown_drain_ms} + RJ_SHUTDOWN_GRACE_MS {s.shutdown_grace_ms} + "
            f"{STOP_MARGIN_S:g} s")


@rule("stop-grace", reads_settings=True)
def stop_grace(d: Deployment) -> Verdict:
    name, s = d.balancer.name, d.settings
    raw = d.balancer.raw.get("stop_grace_period")
    given = COMPOSE_DEFAULT_STOP_S if raw is None else compose_duration(str(raw))
    shown = "unset (Compose's default, 10s)" if raw is None else str(raw)
    if given is None:
        return False, (f"service {name}: stop_grace_period {raw!r} is not a Compose duration; write it like 75s "
                       "or 1m15s")
    need = stop_needs_s(s)
    if given < need:
        return False, (f"service {name}: stop_grace_period {shown} is shorter than {_phases(s)} to cancel the rest "
                       f"and save the state file (at least {need:g}s): Docker would SIGKILL the balancer {given:g} s "
                       "after SIGTERM, cutting every request still in flight and losing what it learnt since its "
                       "last save")
    return True, (f"service {name}: stop_grace_period {raw} covers the drain ({s.shutdown_drain_ms} ms) and the grace "
                  f"({s.shutdown_grace_ms} ms) with {given - need + STOP_MARGIN_S:g} s left to cancel the rest and "
                  f"save the state file (at least {STOP_MARGIN_S:g} s needed)")


@rule("engine-stop-grace")
def engine_stop_grace(d: Deployment) -> Verdict:
    name, raw = d.engine.name, d.engine.raw.get("stop_grace_period")
    given = COMPOSE_DEFAULT_STOP_S if raw is None else compose_duration(str(raw))
    if given is None:
        return False, f"service {name}: stop_grace_period {raw!r} is not a Compose duration; write it like 120s or 2m"
    if given < ENGINE_STOP_S:
        shown = "unset (Compose's default, 10s)" if raw is None else str(raw)
        return False, (f"service {name}: stop_grace_period {shown} is shorter than {ENGINE_STOP_S:g}s: Docker would "
                       f"SIGKILL SGLang {given:g} s after SIGTERM, while its eight schedulers and its tokenizer workers "
                       "are still stopping (the Rust Ramjet's bundle gives the engine 120s)")
    return True, f"service {name}: stop_grace_period {raw} (at least {ENGINE_STOP_S:g}s)"


@k8s_rule("termination-grace", reads_settings=True)
def termination_grace(c: Cluster) -> Verdict:
    s, given = c.settings, dig(c.spec, "terminationGracePeriodSeconds")
    period = KUBERNETES_DEFAULT_GRACE_S if given is None else given
    if not isinstance(period, int) or isinstance(period, bool):
        return False, f"terminationGracePeriodSeconds {period!r} is not a number of seconds"
    need = stop_needs_s(s)
    if period < need:
        return False, (f"terminationGracePeriodSeconds {period} < {_phases(s)} (at least {need:g}): the kubelet "
                       f"would SIGKILL the balancer {period} s after SIGTERM, cutting every request still in flight")
    return True, (f"terminationGracePeriodSeconds {period} covers the drain ({s.shutdown_drain_ms} ms) and the grace "
                  f"({s.shutdown_grace_ms} ms) with {period - need + STOP_MARGIN_S:g} s left to cancel the rest and "
                  "save the state file")

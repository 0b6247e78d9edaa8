"""The rule for stopping the balancer: Docker must wait for its drain and grace before it kills it.

On SIGTERM the balancer answers /readyz with 503 and keeps serving for RJ_SHUTDOWN_DRAIN_MS, then closes
its listeners and lets requests in flight finish for up to RJ_SHUTDOWN_GRACE_MS, then cancels what is
left (waiting up to 5 s for them) and saves its state file (docs/operations.md, "Shutdown and rolling
upgrades"). `docker compose stop`, `down` and `up -d` (which recreates a changed container) send SIGTERM,
and SIGKILL `stop_grace_period` later, 10 s by default: with the defaults that would cut every stream
still running 5 s into the grace. The rule is registered in ramjet/ops/rules.py (RULES).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ramjet.config import Settings

if TYPE_CHECKING:
    from ramjet.ops.rules import Deployment, Verdict

COMPOSE_DEFAULT_STOP_S = 10.0
# After the grace the balancer cancels what still runs and waits up to 5 s for those requests to be aborted
# upstream (ramjet/balancer/serve.py, CANCEL_WAIT_S), then saves its state file: leave it 10 s for both.
STOP_MARGIN_S = 10.0
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|m|s|us|µs|ns)")


def compose_duration(text: str) -> float | None:
    """Seconds in a Compose duration (Go's syntax: `75s`, `1m15s`, `1.5m`, `500ms`), or None if unreadable."""
    text = text.strip()
    if not text or _PART.sub("", text):
        return None
    return sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))


def shutdown_ms(env: dict[str, str], name: str) -> int | None:
    """RJ_SHUTDOWN_{DRAIN,GRACE}_MS as the balancer reads it: the variable, else the field's default."""
    value = env.get(f"RJ_{name.upper()}", "").strip()
    if not value:  # an empty value means unset: the default applies
        return int(Settings.model_fields[name].default)
    return int(value) if value.isdigit() else None


def stop_grace(d: Deployment) -> Verdict:
    name = d.balancer.name
    drain, grace = shutdown_ms(d.env, "shutdown_drain_ms"), shutdown_ms(d.env, "shutdown_grace_ms")
    if drain is None or grace is None:
        return None, ("RJ_SHUTDOWN_DRAIN_MS or RJ_SHUTDOWN_GRACE_MS is not a number of milliseconds "
                      "(see balancer-config)")
    raw = d.balancer.raw.get("stop_grace_period")
    given = COMPOSE_DEFAULT_STOP_S if raw is None else compose_duration(str(raw))
    shown = "unset (Compose's default, 10s)" if raw is None else str(raw)
    if given is None:
        return False, (f"service {name}: stop_grace_period {raw!r} is not a Compose duration; write it like 75s "
                       "or 1m15s")
    need = (drain + grace) / 1000 + STOP_MARGIN_S
    if given < need:
        return False, (f"service {name}: stop_grace_period {shown} is shorter than RJ_SHUTDOWN_DRAIN_MS {drain} + "
                       f"RJ_SHUTDOWN_GRACE_MS {grace} + {STOP_MARGIN_S:g} s to cancel the rest and save the state "
                       f"file (at least {need:g}s): Docker would SIGKILL the balancer {given:g} s after SIGTERM, "
                       "cutting every request still in flight and losing what it learnt since its last save")
    return True, (f"service {name}: stop_grace_period {raw} covers the drain ({drain} ms) and the grace "
                  f"({grace} ms) with {given - need + STOP_MARGIN_S:g} s left to cancel the rest and save the state "
                  f"file (at least {STOP_MARGIN_S:g} s needed)")

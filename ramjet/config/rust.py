"""The Rust Ramjet's variables that are not ours: honoured, mapped, or accepted at their off value.

A Compose file written for the Rust Ramjet must keep working here (docs/configuration.md,
"Variables from the Rust Ramjet"), so each of its variables that this balancer has no
field of its own for is declared here, as one of three kinds:

- honoured, with the Rust meaning: RJ_ADVERTISE_CTX_MARGIN, RJ_MAX_TOKENS_STRIP, and the
  decode load model (RJ_ROUTE_PHASE_AWARE_LOAD, RJ_ROUTE_DECODE_LOAD_UNIT_TOKENS,
  RJ_ROUTE_DECODE_MAX_LOAD_UNITS; routing/decode_load.py); their defaults leave ours alone;
- mapped to ours: RJ_KV_EVENT_MODE=off is RJ_KV_EVENTS=off;
- accepted only at the value that turns the Rust feature off (`off`, for admission `http`),
  because the feature does not exist here; any other value stops start-up with a message
  naming what to use instead, so a bundle never runs believing it has a feature it lacks.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import NonNegativeInt, PositiveInt, ValidationInfo, field_validator
from pydantic_settings import BaseSettings

from ramjet.config.values import FALSE_WORDS

PRECISE = ("precise mode: RJ_KV_EVENTS=zmq with RJ_TOKENIZER (the model's tokenizer directory); "
           "`ramjet check-precise URL` says whether it is safe on your engine")

# Variable (field) -> (the one value accepted, what to use instead of any other).
OFF_ONLY: dict[str, tuple[str, str]] = {
    "kv_event_mode": ("off", ("the Rust Ramjet's observation-only KV event inventory has no equivalent here: this "
                              f"balancer either routes on the engines' KV events ({PRECISE}) or does not read them")),
    "tokenizer_mode": ("off", ("the Rust Ramjet's shadow tokenization does not exist here: this balancer tokenizes "
                               f"requests only to route on the engines' KV events ({PRECISE})")),
    "exact_route_mode": ("off", ("exact routing on engine-reported blocks is this balancer's "
                                 f"{PRECISE} (no manifests, no canary cohort)")),
    "snapshot_route_mode": ("off", ("snapshot-companion inventories do not exist here: this balancer reads the "
                                    "engines' own KV event publishers (RJ_KV_EVENTS=zmq, RJ_KV_EVENTS_ENDPOINT)")),
    "upstream_admission_mode": ("http", ("compatibility admission (engine identity against a pinned manifest) "
                                         "does not exist here: a replica is admitted by its readiness probe "
                                         "(RJ_HEALTH_PATH, /v1/models as the Rust http mode probes) and, per DP "
                                         "rank, by RJ_UPSTREAM_RANK_PROBE=on")),
    "idle_drain_mode": ("off", ("idle draining and engine parking do not exist here: drain a replica by hand "
                                "through the operator API (POST /admin/replicas/{ordinal}/drain)")),
}


class RustCompat(BaseSettings):
    """The Rust Ramjet's variables (field `foo` is RJ_FOO), before Settings' own; see the module docstring."""

    # honoured: 0 turns each off (the Rust Ramjet's defaults, 16384 and 100000, are not ours: docs)
    advertise_ctx_margin: NonNegativeInt = 0   # tokens taken off the context length GET /v1/models advertises
    max_tokens_strip: NonNegativeInt = 0       # a client's max_tokens at or above this is dropped
    # honoured, opt-in: any of the three switches from our load model to the Rust one (Settings.load_model)
    route_phase_aware_load: bool | None = None
    route_decode_load_unit_tokens: NonNegativeInt | None = None
    route_decode_max_load_units: PositiveInt | None = None
    # mapped / accepted when off (OFF_ONLY)
    kv_event_mode: Literal["off"] | None = None
    tokenizer_mode: Literal["off"] | None = None
    exact_route_mode: Literal["off"] | None = None
    snapshot_route_mode: Literal["off"] | None = None
    upstream_admission_mode: Literal["http"] | None = None
    idle_drain_mode: Literal["off"] | None = None

    @field_validator(*OFF_ONLY, mode="before")
    @classmethod
    def _v_off_only(cls, v: Any, info: ValidationInfo) -> Any:
        accepted, instead = OFF_ONLY[info.field_name]
        if not isinstance(v, str):
            return v
        word = v.strip().lower()
        if word == accepted or (accepted == "off" and word in FALSE_WORDS):
            return accepted
        raise ValueError(f"is accepted only as {accepted!r} (the Rust Ramjet's value that turns the feature off): "
                         f"{instead}; set it to {accepted!r} or remove it")


def rust_combinations(s: Any) -> list[str]:
    """Rules between a Rust variable and ours (called by load_settings with the built Settings)."""
    out = []
    if s.kv_event_mode == "off" and s.kv_events != "off":
        out.append(f"RJ_KV_EVENT_MODE=off and RJ_KV_EVENTS={s.kv_events} disagree: RJ_KV_EVENT_MODE is the Rust "
                   "Ramjet's name, and off here means RJ_KV_EVENTS=off; remove RJ_KV_EVENT_MODE to route on the "
                   "engines' KV events")
    cap = s.route_decode_max_load_units
    if cap is not None and cap > s.route_max_load_units:
        out.append(f"RJ_ROUTE_DECODE_MAX_LOAD_UNITS={cap} exceeds RJ_ROUTE_MAX_LOAD_UNITS="
                   f"{s.route_max_load_units}; a request's decode reservation must fit its whole reservation's cap")
    return out

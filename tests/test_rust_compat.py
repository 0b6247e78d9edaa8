"""The Rust Ramjet's variables (config/rust.py): its GLM-5.3 bundle read as Compose reads it, each variable
honoured, mapped or accepted when off, and the arithmetic behind the honoured ones, as pure functions."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.proxy.models import is_models_path, shrink_context
from ramjet.balancer.proxy.request import strip_max_tokens
from ramjet.bench.placements import PlacementContext, balancer_env, parse_placement
from ramjet.config import KNOWN_VARS, ConfigError, load_settings
from ramjet.config.rust import OFF_ONLY
from ramjet.ops.compose import load_bundle
from ramjet.routing.decode_load import INVALID, UNSET, LoadModel, RequestLoad, bucket, decode_units, output_limit

pytestmark = pytest.mark.unit

BUNDLE = Path(__file__).parent / "fixtures" / "rust-bundle"
UP = {"RJ_UPSTREAM": "http://e:1"}
RUST_LOAD = {"RJ_ROUTE_PHASE_AWARE_LOAD": "true", "RJ_ROUTE_DECODE_LOAD_UNIT_TOKENS": "256",
             "RJ_ROUTE_DECODE_MAX_LOAD_UNITS": "4"}


def bundle_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The fixture's `ramjet` environment as `docker compose` resolves it (no .env beside it)."""
    return load_bundle(BUNDLE, environ=environ or {}).services["ramjet"].environment


def problems(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_settings(env)
    return str(e.value)


# --- the bundle ---------------------------------------------------------------------------------

def test_the_bundle_resolves_as_compose_does_and_every_variable_is_known():
    env = bundle_env()
    assert env["RJ_UPSTREAM_TOKEN"] == "glm-local" and env["RJ_ROUTE_ALPHA"] == "4"  # ${VAR:-default}
    assert env["RJ_ROUTE_PHASE_AWARE_LOAD"] == "true" and env["RJ_ROUTE_JOURNAL"] == "true"
    assert len(env) == 21 and set(env) <= set(KNOWN_VARS)
    assert bundle_env({"RJ_ROUTE_ALPHA": "2"})["RJ_ROUTE_ALPHA"] == "2"  # the shell wins, as in Compose


def test_the_bundle_is_honoured_with_the_rust_meaning():
    s = load_settings(bundle_env())
    assert s.upstream_dp_ranks == list(range(8)) and len(s.upstreams) == 8
    assert s.upstream_token.get_secret_value() == "glm-local" and s.upstream_rank_probe is True
    assert (s.affinity, s.route_affinity_basis, s.route_alpha, s.route_max_overlap_blocks,
            s.route_max_attempts) == ("prefix", "relative", 4.0, 32, 3)
    assert (s.advertise_ctx_margin, s.max_tokens_strip) == (8192, 0)
    assert s.load_model == LoadModel(phase_aware=True, unit_tokens=256, max_units=4)
    assert s.journal_target == "stdout"  # RJ_ROUTE_JOURNAL=true: the records on stdout, as the Rust switch
    assert s.kv_events == "off"  # RJ_KV_EVENT_MODE=off, mapped


def test_without_the_rust_variables_nothing_of_ours_changes():
    s = load_settings(UP)
    assert (s.load_model, s.advertise_ctx_margin, s.max_tokens_strip) == (None, 0, 0)
    for var, (accepted, _) in OFF_ONLY.items():
        assert getattr(s, var) is None
    # any one of the three switches to the Rust model, with the Rust defaults for the other two
    assert load_settings({**UP, "RJ_ROUTE_PHASE_AWARE_LOAD": "false"}).load_model == LoadModel(False, 0, 4)
    assert load_settings({**UP, "RJ_ROUTE_DECODE_LOAD_UNIT_TOKENS": "128", "RJ_ROUTE_MAX_LOAD_UNITS": "2"}
                         ).load_model == LoadModel(False, 128, 2)


@pytest.mark.parametrize("var, instead", [
    ("RJ_KV_EVENT_MODE", "RJ_KV_EVENTS=zmq"), ("RJ_TOKENIZER_MODE", "RJ_TOKENIZER"),
    ("RJ_EXACT_ROUTE_MODE", "RJ_KV_EVENTS=zmq"), ("RJ_SNAPSHOT_ROUTE_MODE", "RJ_KV_EVENTS_ENDPOINT"),
    ("RJ_UPSTREAM_ADMISSION_MODE", "RJ_HEALTH_PATH"), ("RJ_IDLE_DRAIN_MODE", "/admin/replicas/{ordinal}/drain")])
def test_a_rust_feature_that_does_not_exist_here_is_refused_naming_what_to_use(var, instead):
    accepted = "http" if var == "RJ_UPSTREAM_ADMISSION_MODE" else "off"
    assert load_settings({**UP, var: accepted.upper()})  # the off value, in any case
    for value in ("shadow", "placement", "compatibility", "drain"):
        if value == accepted:
            continue
        line = next(ln for ln in problems({**UP, var: value}).splitlines() if var in ln)
        assert f"{var}={value!r}" in line and f"set it to {accepted!r} or remove it" in line and instead in line


def test_off_words_are_off_and_the_admission_mode_is_http():
    assert load_settings({**UP, "RJ_IDLE_DRAIN_MODE": "false", "RJ_TOKENIZER_MODE": " 0 "}).idle_drain_mode == "off"
    assert "RJ_UPSTREAM_ADMISSION_MODE='off'" in problems({**UP, "RJ_UPSTREAM_ADMISSION_MODE": "off"})


def test_kv_event_mode_off_conflicts_with_our_precise_mode():
    msg = problems({**UP, "RJ_KV_EVENT_MODE": "off", "RJ_KV_EVENTS": "zmq", "RJ_TOKENIZER": "ramjet/sim/tokenizer"})
    assert "RJ_KV_EVENT_MODE=off and RJ_KV_EVENTS=zmq disagree" in msg
    assert load_settings({**UP, "RJ_KV_EVENT_MODE": "off", "RJ_KV_EVENTS": "off"}).kv_events == "off"


def test_bad_values_of_the_honoured_variables_are_clear_errors():
    msg = problems({**UP, "RJ_ADVERTISE_CTX_MARGIN": "-1", "RJ_MAX_TOKENS_STRIP": "lots",
                    "RJ_ROUTE_PHASE_AWARE_LOAD": "maybe", "RJ_ROUTE_DECODE_MAX_LOAD_UNITS": "0"})
    for var in ("RJ_ADVERTISE_CTX_MARGIN='-1'", "RJ_MAX_TOKENS_STRIP='lots'", "RJ_ROUTE_PHASE_AWARE_LOAD='maybe'",
                "RJ_ROUTE_DECODE_MAX_LOAD_UNITS='0'"):
        assert var in msg
    msg = problems({**UP, "RJ_ROUTE_DECODE_MAX_LOAD_UNITS": "9"})
    assert "RJ_ROUTE_DECODE_MAX_LOAD_UNITS=9 exceeds RJ_ROUTE_MAX_LOAD_UNITS=8" in msg


def test_the_rust_load_model_is_a_placement_setting_of_the_comparison(tmp_path):
    text = "relative:" + ":".join(f"{k}={v}" for k, v in RUST_LOAD.items())
    env = balancer_env(parse_placement(text), ["http://127.0.0.1:1"], PlacementContext(log_dir=tmp_path))
    assert load_settings(env).load_model == LoadModel(True, 256, 4)


# --- the decode load model, as arithmetic ----------------------------------------------------------

def test_the_output_limit_is_read_per_route_as_the_rust_ramjet_reads_it():
    assert output_limit("chat", {"max_completion_tokens": 300, "max_tokens": 10}) == 300
    assert output_limit("chat", {"max_completion_tokens": None, "max_tokens": 10}) == 10  # null: absent
    assert output_limit("chat", {"max_completion_tokens": "300", "max_tokens": 10}) == INVALID  # no fallback
    assert output_limit("completions", {"max_completion_tokens": 5}) == UNSET
    assert output_limit("messages", {"max_tokens": 64}) == 64
    assert output_limit("responses", {"max_output_tokens": 5000}) == 5000
    assert output_limit("generate", {"sampling_params": {"max_new_tokens": 7}}) == 7
    assert output_limit("generate", {"sampling_params": "x"}) == UNSET
    for bad in (0, -3, 1.5, True, [4]):
        assert output_limit("chat", {"max_tokens": bad}) == INVALID


def test_buckets_and_their_decode_units():
    assert [bucket(n) for n in (1, 64, 65, 256, 257, 1024, 1025, 4096, 4097)] == [
        "1_64", "1_64", "65_256", "65_256", "257_1024", "257_1024", "1025_4096", "1025_4096", "4097_plus"]
    # the bundle's 256 tokens a unit, at most 4: the upper edge / 256, rounded up
    assert [decode_units(n, 256, 4) for n in (1, 64, 200, 300, 1024, 2000, 9000, UNSET, INVALID)] == [
        1, 1, 1, 4, 4, 4, 4, 4, 4]
    assert [decode_units(n, 64, 8) for n in (10, 100, 500)] == [1, 4, 8]
    assert decode_units(5000, 0, 4) == decode_units(UNSET, 0, 4) == 1  # 0 tokens a unit: one unit, always


def test_a_request_reserves_a_decode_floor_and_gives_back_the_prefill_only_when_streamed_and_phase_aware():
    rust = LoadModel(phase_aware=True, unit_tokens=256, max_units=4)
    streamed = rust.request("chat", {"max_tokens": 300, "stream": True})
    assert streamed == RequestLoad(decode=4, releases=True)
    assert streamed.reserve(6.5) == 6.5 and streamed.reserve(0.25) == 4.0  # a floor, not an addition
    assert streamed.after_first_byte(6.5) == 4.0 and streamed.after_first_byte(4.0) == 4.0
    whole = rust.request("chat", {"max_tokens": 300, "stream": None})  # stream null: not streamed
    assert not whole.releases and whole.after_first_byte(6.5) == 6.5
    held = LoadModel(False, 256, 4).request("chat", {"max_tokens": 20, "stream": True})
    assert held.reserve(0.125) == 1.0 and held.after_first_byte(1.0) == 1.0


def test_a_reservation_keeps_what_it_is_told_at_the_first_byte():
    f = Fleet([Replica(0, "http://e", 0, "engine0", "http://e")], Metrics(), liveness_window_s=30.0, unfence_after=1)
    with f.reserve(0, 6.5) as held:
        held.prefill_done(4.0)
        assert f.loads()[0] == 4.0 and f.view(0).in_flight == 1
    with f.reserve(0, 2.0) as held:
        held.prefill_done(float("inf"))  # kept whole
        assert f.loads()[0] == 2.0
    assert f.loads()[0] == 0 and f.view(0).in_flight == 0


# --- RJ_MAX_TOKENS_STRIP and RJ_ADVERTISE_CTX_MARGIN ------------------------------------------------

def test_max_tokens_at_or_above_the_threshold_are_dropped_and_the_body_rewritten_only_then():
    raw = b'{"model": "m", "max_tokens": 100000, "max_completion_tokens": 99999, "stream": true}'
    body = orjson.loads(raw)
    out = strip_max_tokens("chat", body, raw, 100_000)
    assert orjson.loads(out) == {"model": "m", "max_completion_tokens": 99999, "stream": True} == body
    keep = b'{"max_tokens": 5, "max_completion_tokens": 1.5e6}'
    assert strip_max_tokens("chat", orjson.loads(keep), keep, 100) is keep  # floats stay, as in Rust
    big = b'{"max_tokens": 200000}'
    assert strip_max_tokens("chat", orjson.loads(big), big, 0) is big  # 0: off
    assert strip_max_tokens("messages", orjson.loads(big), big, 10) is big  # chat and completions only
    assert orjson.loads(strip_max_tokens("completions", orjson.loads(big), big, 10)) == {}


def test_the_advertised_context_loses_the_margin_and_anything_else_passes_untouched():
    listing = orjson.dumps({"object": "list", "data": [
        {"id": "glm-5.3", "max_model_len": 262144, "meta": {"context_length": 262144, "other": 5}},
        {"id": "tiny", "max_model_len": 4096}]})
    out = orjson.loads(shrink_context(listing, 8192))
    assert out["data"][0]["max_model_len"] == 253952 and out["data"][0]["meta"] == {"context_length": 253952,
                                                                                     "other": 5}
    assert out["data"][1]["max_model_len"] == 4096  # not above the margin: left as it is
    single = orjson.dumps({"id": "glm-5.3", "object": "model", "max_model_len": 10000})
    assert orjson.loads(shrink_context(single, 1000))["max_model_len"] == 9000
    for body in (b"{not json", b"[1, 2]", b'{"data": "x"}', b'{"id": "m", "max_model_len": 50}', listing):
        assert shrink_context(body, 0 if body == listing else 8192) is body
    assert is_models_path("/v1/models") and is_models_path("/v1/models/glm-5.3") and not is_models_path("/v1/x")

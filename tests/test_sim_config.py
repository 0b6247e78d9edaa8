"""`ramjet sim`'s flags are generated from SimConfig: each sets its field, the defaults are the model's,
and a bad value exits 2 naming the flag (or environment variable) it came from."""

import argparse
import json

import pytest
import uvicorn
from pydantic import ValidationError
from sim_helpers import sim_client

from ramjet import cli as ramjet_cli
from ramjet.sim import cli
from ramjet.sim.config import SimConfig

pytestmark = pytest.mark.unit

EVENTS = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"})

# What the benchmark, the demo, the tests and docs/simulator.md pass to `ramjet sim`: these names must not change.
KNOWN_FLAGS = {
    "--host", "--port", "--log-level", "--dp-size", "--model-name", "--api-key", "--kv-tokens-per-rank",
    "--page-tokens", "--hicache-tokens-per-rank", "--prefill-tokens-per-s", "--hicache-load-tokens-per-s",
    "--decode-tokens-per-s", "--max-running-per-rank", "--chunked-prefill", "--prefill-decode-share",
    "--decode-context-tokens", "--time-scale", "--idle-keepalive-s", "--fault", "--response-header",
    "--poison-text", "--tokenizer", "--kv-events-config", "--kv-events-format", "--load-publish-endpoint",
}

# One non-default value per flag: (argv, the field's expected value).
EVERY_FLAG = {
    "dp_size": (["--dp-size", "4"], 4),
    "model_name": (["--model-name", "glm-test"], "glm-test"),
    "api_key": (["--api-key", "s3cret"], "s3cret"),
    "kv_tokens_per_rank": (["--kv-tokens-per-rank", "4096"], 4096),
    "page_tokens": (["--page-tokens", "32"], 32),
    "hicache_tokens_per_rank": (["--hicache-tokens-per-rank", "16384"], 16384),
    "prefill_tokens_per_s": (["--prefill-tokens-per-s", "1e4"], 10_000.0),
    "hicache_load_tokens_per_s": (["--hicache-load-tokens-per-s", "50000"], 50_000.0),
    "decode_tokens_per_s": (["--decode-tokens-per-s=32"], 32.0),
    "max_running_per_rank": (["--max-running-per-rank", "4"], 4),
    "chunked_prefill": (["--chunked-prefill", "8192"], 8192),
    "prefill_decode_share": (["--prefill-decode-share", "1"], 1.0),
    "decode_context_tokens": (["--decode-context-tokens", "0"], 0),
    "time_scale": (["--time-scale", "20"], 20.0),
    "idle_keepalive_s": (["--idle-keepalive-s", "1.5"], 1.5),
    "ideal_max_pages": (["--ideal-max-pages", "1000"], 1000),
    "faults": (["--fault", "3:wedge"], {3: "wedge"}),
    "response_headers": (["--response-header", "X-Test: 1"], {"X-Test": "1"}),
    "poison_text": (["--poison-text", "DROP TABLE"], "DROP TABLE"),
    "tokenizer_dir": (["--tokenizer", "/models/glm"], "/models/glm"),
    "kv_events_format": (["--kv-events-format", "sglang"], "sglang"),  # the only format with a load publisher
    "kv_events_config": (["--kv-events-config", EVENTS], EVENTS),
    "load_publish_endpoint": (["--load-publish-endpoint", "auto"], "auto"),
}


def sim_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ramjet sim")
    cli.add_arguments(parser)
    return parser


def parse(*argv: str) -> argparse.Namespace:
    return sim_parser().parse_args(argv)


def run_sim(capsys, *argv: str) -> tuple[int, str]:
    """`ramjet sim ARGV` as the console script runs it: its exit code and stderr."""
    try:
        code = ramjet_cli.main(["sim", *argv])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.fixture
def no_server(monkeypatch):
    """uvicorn.run records its call instead of serving; the command returns."""
    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append((app, kw)))
    return calls


def test_every_flag_the_tools_pass_still_exists():
    options = {o for action in sim_parser()._actions for o in action.option_strings}
    assert KNOWN_FLAGS <= options


def test_each_flag_sets_its_field():
    flagged = {name for name, *_ in cli.engine_flags()}
    assert flagged == set(EVERY_FLAG), "every flag needs a row here (and every row a flag)"
    default = SimConfig()
    argv = [arg for args, _ in EVERY_FLAG.values() for arg in args]
    config = cli.config_from_args(parse(*argv), environ={})
    for name, (args, value) in EVERY_FLAG.items():
        assert getattr(config, name) == value, args
        if name != "kv_events_format":
            assert getattr(default, name) != value, f"{args} must differ from the default to show it was read"


def test_without_flags_the_models_defaults_apply_and_help_shows_them():
    assert cli.config_from_args(parse(), environ={}) == SimConfig()
    helps = {option: action.help for action in sim_parser()._actions for option in action.option_strings}
    for name, option, field, _ in cli.engine_flags():
        assert helps[option].startswith(field.description), option
        default = getattr(SimConfig(), name)
        if default is not None and not isinstance(default, dict):
            assert helps[option].endswith(f"(default: {default})"), option


def test_health_settings_come_from_sglangs_environment_variables():
    config = cli.config_from_args(parse(), environ={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
                                                     "SGLANG_HEALTH_CHECK_TIMEOUT": "0.5"})
    assert config.health_generation is False and config.health_timeout_s == 0.5
    config = cli.config_from_args(parse(), environ={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "true",
                                                     "SGLANG_HEALTH_CHECK_TIMEOUT": ""})
    assert config.health_generation is True and config.health_timeout_s == 20.0
    with pytest.raises(SystemExit):  # not flags
        parse("--health-timeout-s", "1")


def test_repeatable_flags_collect_every_occurrence():
    args = parse("--dp-size", "4", "--fault", "3:wedge", "--fault", "1:slow", "--fault", "3:none",
                 "--response-header", "Set-Cookie: a=b; Path=/", "--response-header", "X-Ramjet-Upstream:evil:9")
    config = cli.config_from_args(args, environ={})
    assert config.faults == {3: "none", 1: "slow"}  # the last word on a rank wins
    assert config.response_headers == {"Set-Cookie": "a=b; Path=/", "X-Ramjet-Upstream": "evil:9"}


async def test_flags_reach_the_running_engine():
    args = parse("--dp-size", "2", "--fault", "1:error", "--response-header", "X-Test: yes")
    async with sim_client(**cli.config_from_args(args, environ={}).model_dump(exclude={"time_scale"})) as (c, _):
        r = await c.get("/sim/faults")
        assert r.headers["x-test"] == "yes"
        assert r.json()["faults"] == [{"rank": 1, "mode": "error"}]
        assert (await c.get("/get_server_info")).json()["dp_size"] == 2


@pytest.mark.parametrize("argv, flag, says", [
    (["--dp-size", "0"], "--dp-size", "greater than or equal to 1"),
    (["--dp-size", "two"], "--dp-size", "valid integer"),
    (["--time-scale", "0"], "--time-scale", "greater than 0"),
    (["--time-scale", "inf"], "--time-scale", "finite number"),
    (["--prefill-decode-share", "1.5"], "--prefill-decode-share", "less than or equal to 1"),
    (["--hicache-tokens-per-rank", "-1"], "--hicache-tokens-per-rank", "greater than or equal to 0"),
    (["--kv-tokens-per-rank", "32"], "--page-tokens", "does not fit in kv_tokens_per_rank (32)"),
    (["--fault", "8:wedge"], "--fault", "rank 8 is not in [0, dp_size=8)"),
    (["--dp-size", "2", "--fault", "2:slow"], "--fault", "rank 2 is not in [0, dp_size=2)"),
    (["--fault", "3"], "--fault", "expected RANK:MODE"),
    (["--fault", "3:melt"], "--fault", "MODE one of none, wedge, error, slow"),
    (["--response-header", "no-colon"], "--response-header", "expected NAME:VALUE"),
    (["--kv-events-format", "trt"], "--kv-events-format", "invalid choice"),
    (["--kv-events-config", "{not json"], "--kv-events-config", "not JSON"),
    (["--kv-events-config", '{"publisher": "kafka"}'], "--kv-events-config", "unknown event publisher"),
    (["--load-publish-endpoint", "auto"], "--load-publish-endpoint", "needs SGLang-format KV events"),
    (["--kv-events-format", "vllm", "--kv-events-config", '{"enable_kv_cache_events": true}',
      "--load-publish-endpoint", "auto"], "--load-publish-endpoint", "needs SGLang-format KV events"),
    (["--kv-events-config", EVENTS, "--load-publish-endpoint", "udp://h:1"], "--load-publish-endpoint",
     "must be auto, off or tcp://HOST:PORT"),
])
def test_a_bad_value_exits_2_naming_the_flag(capsys, no_server, argv, flag, says):
    code, err = run_sim(capsys, *argv)
    assert code == 2 and not no_server
    assert f"argument {flag}: " in err and says in err and "Traceback" not in err


def test_a_bad_environment_variable_exits_2_naming_it(capsys, no_server, monkeypatch):
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "soon")
    code, err = run_sim(capsys)
    assert code == 2 and not no_server and "environment variable SGLANG_HEALTH_CHECK_TIMEOUT: " in err


def test_a_good_command_line_serves_with_its_settings(capsys, no_server, monkeypatch):
    monkeypatch.delenv("SGLANG_HEALTH_CHECK_TIMEOUT", raising=False)
    code, _ = run_sim(capsys, "--port", "30123", "--idle-keepalive-s", "2.5", "--dp-size", "2")
    assert code == 0
    [(app, kw)] = no_server
    assert kw["port"] == 30123 and kw["timeout_keep_alive"] == 2.5 and len(app.state.engine.ranks) == 2


def test_python_api_names_the_field_and_refuses_typos_and_changes():
    with pytest.raises(ValidationError, match="dp_size"):
        SimConfig(dp_size=0)
    with pytest.raises(ValidationError, match="faults"):
        SimConfig(dp_size=2, faults={2: "wedge"})
    with pytest.raises(ValidationError, match="dp_sise"):
        SimConfig(dp_sise=2)
    config = SimConfig(time_scale=1000, api_key="s3cret", faults={3: "wedge"})
    assert config.time_scale == 1000.0 and config.faults == {3: "wedge"} and "s3cret" not in repr(config)
    with pytest.raises(ValidationError):
        config.dp_size = 2
    assert SimConfig(api_key="").api_key is None  # an empty key requires none, as `--api-key ""` always did

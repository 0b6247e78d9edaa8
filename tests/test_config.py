"""RJ_* settings: defaults, one message naming every problem, secrets never shown."""

import re
from importlib.resources import files
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from ramjet.config import FALSE_WORDS, KNOWN_VARS, TRUE_WORDS, ConfigError, Settings, load_settings
from ramjet.routing.policies import BASES, POLICY_NAMES

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

UP = {"RJ_UPSTREAM": "http://127.0.0.1:30000"}


def problems(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    return str(info.value)


def test_defaults():
    s = load_settings(UP)
    assert s.upstreams == ["http://127.0.0.1:30000"]
    assert s.upstream_dp_ranks is None and s.upstream_dp_size is None and s.topology_file is None
    assert s.upstream_token is None and s.api_keys == []
    assert (s.affinity, s.route_affinity_basis, s.route_alpha) == ("prefix", "relative", 2.0)
    assert s.route_new_sessions == "auto" and s.balance_new_sessions  # new conversations placed for balance
    precise = {**UP, "RJ_KV_EVENTS": "zmq", "RJ_TOKENIZER": str(files("ramjet.sim") / "tokenizer")}
    assert load_settings(precise).balance_new_sessions  # ... in precise mode too (routing/router.py)
    assert not load_settings({**precise, "RJ_ROUTE_NEW_SESSIONS": "affinity"}).balance_new_sessions
    assert (s.route_chunk_bytes, s.route_max_prefix_bytes) == (2048, 2 * 1024 * 1024)
    assert (s.route_max_overlap_blocks, s.route_index_capacity, s.route_kv_capacity_tokens) == (32, 100_000, None)
    assert (s.route_load_unit_bytes, s.route_max_load_units, s.route_max_attempts) == (32768, 8, 3)
    assert (s.upstream_connect_timeout_ms, s.upstream_first_byte_timeout_ms, s.upstream_pool_idle_timeout_ms) \
        == (2000, 120_000, 4000)
    assert s.first_byte_timeout_s == 120.0 and s.connect_timeout_s == 2.0 and s.pool_idle_timeout_s == 4.0
    assert s.max_body_bytes == 16 * 1024 * 1024
    assert (s.api_host, s.api_port, s.metrics_addr, s.metrics_port) == ("0.0.0.0", 8000, None, None)
    assert s.journal_target is None and s.log_level == "info"
    assert (s.health_interval_ms, s.health_timeout_ms, s.health_path) == (5000, 2000, "/health")
    assert s.upstream_rank_probe is False and s.upstream_rank_probe_path == "/generate"
    assert (s.upstream_rank_probe_timeout_ms, s.liveness_window_ms, s.unfence_after) == (10_000, 30_000, 1)
    assert (s.admin_addr, s.admin_host, s.admin_port, s.admin_keys) == ("127.0.0.1:9091", "127.0.0.1", 9091, [])
    assert s.policy_name == "relative"


def test_durations_in_seconds():
    s = load_settings({**UP, "RJ_UPSTREAM_CONNECT_TIMEOUT_MS": "1500", "RJ_UPSTREAM_FIRST_BYTE_TIMEOUT_MS": "90000",
                       "RJ_UPSTREAM_POOL_IDLE_TIMEOUT_MS": "0", "RJ_HEALTH_INTERVAL_MS": "250",
                       "RJ_HEALTH_TIMEOUT_MS": "1", "RJ_UPSTREAM_RANK_PROBE_TIMEOUT_MS": "7000",
                       "RJ_LIVENESS_WINDOW_MS": "45000"})
    assert (s.connect_timeout_s, s.first_byte_timeout_s, s.pool_idle_timeout_s) == (1.5, 90.0, 0.0)
    assert (s.health_interval_s, s.health_timeout_s, s.rank_probe_timeout_s, s.liveness_window_s) \
        == (0.25, 0.001, 7.0, 45.0)
    d = load_settings(UP)
    assert (d.health_timeout_s, d.rank_probe_timeout_s, d.health_interval_s, d.liveness_window_s) \
        == (2.0, 10.0, 5.0, 30.0)


def test_values_parsed():
    s = load_settings({"RJ_UPSTREAM": " http://A:1/ ,https://b/v1/ ", "RJ_API_KEYS": "k1,, k2 ,",
                       "RJ_AFFINITY": "LOAD", "RJ_API_ADDR": "[::]:9000", "RJ_METRICS_ADDR": "127.0.0.1:9100",
                       "RJ_UPSTREAM_RANK_PROBE": "on", "RJ_UPSTREAM_RANK_PROBE_PATH": "/v1/completions",
                       "RJ_UPSTREAM_DP_SIZE": "Auto", "RJ_ROUTE_ALPHA": " 0 ", "RJ_ROUTE_NEW_SESSIONS": "Balance"})
    assert s.upstreams == ["http://a:1", "https://b/v1"]
    assert s.api_keys == ["k1", "k2"]
    assert s.affinity == "load" and s.upstream_dp_size == "auto" and s.route_alpha == 0
    assert s.route_new_sessions == "balance" and s.policy_name == "load"
    assert (s.api_host, s.api_port, s.metrics_host, s.metrics_port) == ("::", 9000, "127.0.0.1", 9100)
    assert s.upstream_rank_probe is True and s.upstream_rank_probe_path == "/v1/completions"
    for word in ("0", "off", "No", "FALSE"):
        assert load_settings({**UP, "RJ_UPSTREAM_RANK_PROBE": word}).upstream_rank_probe is False
    for word in ("1", "ON", "yes", "true"):
        assert load_settings({**UP, "RJ_UPSTREAM_RANK_PROBE": word}).upstream_rank_probe is True
    assert load_settings({**UP, "RJ_UPSTREAM_DP_SIZE": "8"}).upstream_dp_size == 8


def test_empty_value_means_unset():
    s = load_settings({**UP, "RJ_ROUTE_ALPHA": "", "RJ_METRICS_ADDR": " ", "RJ_UPSTREAM_DP_SIZE": ""})
    assert (s.route_alpha, s.metrics_addr, s.upstream_dp_size) == (2.0, None, None)


def test_affinity_basis_from_the_policy_registry():
    for basis in BASES:
        s = load_settings({**UP, "RJ_ROUTE_AFFINITY_BASIS": basis.upper()})
        assert s.route_affinity_basis == s.policy_name == basis
    assert load_settings({**UP, "RJ_ROUTE_AFFINITY_BASIS": "absolute", "RJ_AFFINITY": "load"}).policy_name == "load"
    assert {load_settings({**UP, "RJ_ROUTE_AFFINITY_BASIS": b}).policy_name for b in BASES} | {"load"} \
        == set(POLICY_NAMES)
    line = problems({**UP, "RJ_ROUTE_AFFINITY_BASIS": "relatve"})
    assert "RJ_ROUTE_AFFINITY_BASIS='relatve'" in line and all(repr(b) in line for b in BASES)
    assert "'load'" not in line  # load is RJ_AFFINITY=load, not a basis


def test_bool_words_are_what_pydantic_accepts():
    for word in TRUE_WORDS | {w.upper() for w in TRUE_WORDS}:
        assert TypeAdapter(bool).validate_python(word) is True
    for word in FALSE_WORDS | {w.upper() for w in FALSE_WORDS}:
        assert TypeAdapter(bool).validate_python(word) is False


@pytest.mark.parametrize("var,value,expect", [
    ("RJ_UPSTREAM", "ftp://h:1", "http(s)"),
    ("RJ_UPSTREAM", "http://h:1,,http://g", "entry 1: empty URL"),
    ("RJ_UPSTREAM", "http://h:1?x=1", "query"),
    ("RJ_UPSTREAM_DP_SIZE", "0", "positive integer or 'auto'"),
    ("RJ_UPSTREAM_DP_SIZE", "eight", "positive integer or 'auto'"),
    ("RJ_AFFINITY", "cache", "'prefix' or 'load'"),
    ("RJ_ROUTE_NEW_SESSIONS", "spread", "'affinity' or 'balance'"),
    ("RJ_ROUTE_ALPHA", "-1", "greater than or equal to 0"),
    ("RJ_ROUTE_ALPHA", "nan", "finite"),
    ("RJ_ROUTE_CHUNK_BYTES", "32", "greater than or equal to 64"),
    ("RJ_ROUTE_MAX_OVERLAP_BLOCKS", "0", "greater than 0"),
    ("RJ_ROUTE_INDEX_CAPACITY", "lots", "valid integer"),
    ("RJ_ROUTE_KV_CAPACITY_TOKENS", "0", "greater than 0"),
    ("RJ_ROUTE_MAX_ATTEMPTS", "0", "greater than 0"),
    ("RJ_UPSTREAM_FIRST_BYTE_TIMEOUT_MS", "2.5s", "valid integer"),
    ("RJ_MAX_BODY_BYTES", "0", "greater than 0"),
    ("RJ_API_ADDR", "8000", "host:port"),
    ("RJ_METRICS_ADDR", "[::]:0", "out of range"),
    ("RJ_LOG_LEVEL", "verbose", "'debug', 'info', 'warning' or 'error'"),
    ("RJ_HEALTH_INTERVAL_MS", "0", "greater than 0"),
    ("RJ_HEALTH_PATH", "health", "starting with '/'"),
    ("RJ_UPSTREAM_RANK_PROBE", "maybe", "valid boolean"),
    ("RJ_UPSTREAM_DP_RANKS", "0,x", "entry 1: Input should be a valid integer"),
    ("RJ_UPSTREAM_DP_RANKS", "-1", "entry 0: Input should be greater than or equal to 0"),
    ("RJ_ADMIN_ADDR", "localhost", "host:port"),
    ("RJ_UPSTREAM_RANK_PROBE_PATH", "/v1/chat/completions", "'/generate' or '/v1/completions'"),
    ("RJ_UNFENCE_AFTER", "0", "greater than 0"),
])
def test_invalid_value_named(var, value, expect):
    msg = problems({**UP, var: value})
    line = next(ln for ln in msg.splitlines() if var + "=" in ln)
    assert repr(value) in line and expect in line


def test_journal_target(tmp_path: Path):
    for v in ("true", "1", "on", "ON", "yes"):
        assert load_settings({**UP, "RJ_ROUTE_JOURNAL": v}).journal_target == "stdout"
    for v in ("false", "0", "off", "", "No"):
        assert load_settings({**UP, "RJ_ROUTE_JOURNAL": v}).journal_target is None
    path = tmp_path / "journal.jsonl"
    assert load_settings({**UP, "RJ_ROUTE_JOURNAL": str(path)}).journal_target == path
    assert "is a directory" in problems({**UP, "RJ_ROUTE_JOURNAL": str(tmp_path)})


def test_unknown_variable_named_with_suggestion():
    msg = problems({**UP, "RJ_ROUTE_ALPAH": "2", "RJ_TOTALLY_NEW": "1"})
    assert "RJ_ROUTE_ALPAH: unknown variable" in msg and "did you mean RJ_ROUTE_ALPHA?" in msg
    assert "RJ_TOTALLY_NEW: unknown variable" in msg
    assert "rj_upstream" in problems({**UP, "rj_upstream": "http://x"})  # names are upper-case only


def test_other_variables_ignored():
    assert load_settings({**UP, "PATH": "/bin", "RJX": "1"}).upstreams == [UP["RJ_UPSTREAM"]]


def test_every_problem_in_one_message():
    msg = problems({"RJ_UPSTREAM": "nope", "RJ_ROUTE_ALPHA": "x", "RJ_LOG_LEVEL": "loud",
                    "RJ_UPSTREAM_DP_RANKS": "0", "RJ_UPSTREAM_DP_SIZE": "8", "RJ_HEALTH_INTRVAL_MS": "10"})
    for name in ("RJ_UPSTREAM=", "RJ_ROUTE_ALPHA=", "RJ_LOG_LEVEL=", "RJ_HEALTH_INTRVAL_MS",
                 "RJ_UPSTREAM_DP_RANKS and RJ_UPSTREAM_DP_SIZE are both set"):
        assert name in msg
    assert len(msg.splitlines()) == 6  # header + five problems, one per line


def test_dp_ranks_and_dp_size_conflict():
    assert "both set" in problems({**UP, "RJ_UPSTREAM_DP_RANKS": "0", "RJ_UPSTREAM_DP_SIZE": "auto"})


def test_ranks_count_must_match_upstreams():
    msg = problems({"RJ_UPSTREAM": "http://a:1,http://a:1,http://a:1", "RJ_UPSTREAM_DP_RANKS": "0,1"})
    assert "RJ_UPSTREAM_DP_RANKS='0,1': has 2 entries but RJ_UPSTREAM has 3" in msg
    s = load_settings({"RJ_UPSTREAM": "http://a:1,http://a:1,http://b:1", "RJ_UPSTREAM_DP_RANKS": "0,1,"})
    assert s.upstream_dp_ranks == [0, 1, None]
    # reported even when another variable is invalid
    msg = problems({"RJ_UPSTREAM": "http://a:1,http://a:1", "RJ_UPSTREAM_DP_RANKS": "0", "RJ_LOG_LEVEL": "loud"})
    assert "has 1 entries but RJ_UPSTREAM has 2" in msg and "RJ_LOG_LEVEL='loud'" in msg


def test_topology_file_conflicts_and_missing_upstream():
    msg = problems({"RJ_TOPOLOGY_FILE": "t.json", "RJ_UPSTREAM": "http://a", "RJ_UPSTREAM_DP_SIZE": "8"})
    assert "RJ_UPSTREAM is set together with RJ_TOPOLOGY_FILE" in msg
    assert "RJ_UPSTREAM_DP_SIZE is set together with RJ_TOPOLOGY_FILE" in msg
    assert "no upstream configured" in problems({})
    assert "no upstream configured" not in problems({"RJ_UPSTREAM": "nope"})  # set, but invalid
    assert load_settings({"RJ_TOPOLOGY_FILE": "t.json"}).topology_file == Path("t.json")


def test_prefix_must_hold_a_block():
    msg = problems({**UP, "RJ_ROUTE_CHUNK_BYTES": "4096", "RJ_ROUTE_MAX_PREFIX_BYTES": "1024", "RJ_ROUTE_ALPHA": "x"})
    assert "RJ_ROUTE_MAX_PREFIX_BYTES='1024': 1024 is smaller than RJ_ROUTE_CHUNK_BYTES (4096)" in msg
    assert "RJ_ROUTE_ALPHA='x'" in msg
    msg = problems({**UP, "RJ_ROUTE_CHUNK_BYTES": str(4 * 1024 * 1024)})  # against the default prefix
    assert "RJ_ROUTE_MAX_PREFIX_BYTES: 2097152 is smaller than RJ_ROUTE_CHUNK_BYTES (4194304)" in msg


def test_secret_never_shown():
    token = "sk-upstream-VERYSECRET"
    s = load_settings({**UP, "RJ_UPSTREAM_TOKEN": token, "RJ_API_KEYS": "client-KEY1", "RJ_ADMIN_KEYS": "admin-KEY2"})
    assert s.upstream_token.get_secret_value() == token
    for text in (str(s), repr(s), str(s.model_dump())):
        assert token not in text
    for key in ("client-KEY1", "admin-KEY2"):
        assert key not in str(s) and key not in repr(s) and key not in str(s.model_dump())
    bad = "sk bad\ntoken"
    msg = problems({**UP, "RJ_UPSTREAM_TOKEN": bad, "RJ_API_KEYS": "k", "RJ_ROUTE_ALPHA": "x"})
    assert "RJ_UPSTREAM_TOKEN" in msg and "sk bad" not in msg
    msg = problems({**UP, "RJ_ADMIN_KEYS": "admin-KEY3", "RJ_ADMIN_ADDR": "nope", "RJ_API_KEYS": "client-KEY4"})
    assert "RJ_ADMIN_ADDR='nope'" in msg and "admin-KEY3" not in msg and "client-KEY4" not in msg
    assert "credentials" in (msg := problems({"RJ_UPSTREAM": "http://user:pw123@h:1"})) and "pw123" not in msg


def test_kv_capacity_derivation():
    s = load_settings({**UP, "RJ_ROUTE_KV_CAPACITY_TOKENS": "1000000"})
    assert s.index_capacity_for(None) == 1954  # ceil(1e6 tokens * 4 bytes / 2048-byte blocks) = ceil(1953.125)
    assert s.index_capacity_for(512) == 1  # a per-replica value (topology file) wins over the global one
    assert load_settings(UP).index_capacity_for(2048) == 4
    assert load_settings(UP).index_capacity_for(None) == 100_000
    explicit = load_settings({**UP, "RJ_ROUTE_KV_CAPACITY_TOKENS": "1000000", "RJ_ROUTE_INDEX_CAPACITY": "5000"})
    assert explicit.index_capacity_for(None) == explicit.index_capacity_for(123456) == 5000


def test_no_dotenv_and_environ_isolated(tmp_path, monkeypatch):
    (tmp_path / ".env").write_text("RJ_ROUTE_ALPHA=9\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RJ_ROUTE_ALPHA", "7")
    assert load_settings(UP).route_alpha == 2.0  # neither .env nor os.environ when a mapping is given
    monkeypatch.setenv("RJ_UPSTREAM", "http://x:1")
    assert load_settings().route_alpha == 7.0


def test_known_vars_match_fields():
    assert "RJ_UPSTREAM" in KNOWN_VARS and "RJ_UNFENCE_AFTER" in KNOWN_VARS and "RJ_ADMIN_KEYS" in KNOWN_VARS
    assert len(KNOWN_VARS) == len(Settings.model_fields)


def doc_tables() -> list[list[list[str]]]:
    """docs/configuration.md's tables: each a list of rows, each row a list of cells (header row first)."""
    tables: list[list[list[str]]] = []
    previous = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("|") and not re.fullmatch(r"[|\-: ]+", line):
            if not previous.startswith("|"):
                tables.append([])
            tables[-1].append([c.strip() for c in line.strip("|").split("|")])
        previous = line
    return tables


def test_documented_variables_are_the_known_ones():
    tables = doc_tables()
    # A variable is documented by a row of its own in a "Variable | Default | ..." table.
    documented = {m for t in tables if t[0][:2] == ["Variable", "Default"] for row in t[1:]
                  for m in re.findall(r"`(RJ_[A-Z_]+)`", row[0])}
    mentioned = {m for t in tables for row in t for cell in row for m in re.findall(r"RJ_[A-Z_]+", cell)}
    assert len(documented) > 30
    assert sorted(set(KNOWN_VARS) - documented) == [], "in the code but without a row in docs/configuration.md"
    assert sorted(mentioned - set(KNOWN_VARS)) == [], "in docs/configuration.md but unknown to the code"


def test_admin_listener_defaults_to_loopback_and_can_be_turned_off():
    s = load_settings(UP)
    assert (s.admin_host, s.admin_port, s.admin_keys) == ("127.0.0.1", 9091, [])
    for off in ("", "off", "OFF", " false "):
        s = load_settings({**UP, "RJ_ADMIN_ADDR": off})
        assert (s.admin_addr, s.admin_host, s.admin_port) == (None, None, None)
    for addr, host in (("[::1]:9200", "::1"), ("localhost:9200", "localhost"), ("127.0.0.2:9200", "127.0.0.2")):
        s = load_settings({**UP, "RJ_ADMIN_ADDR": addr})  # loopback: no key needed
        assert (s.admin_host, s.admin_port) == (host, 9200)


def test_admin_keys_required_off_loopback():
    for addr in ("0.0.0.0:9091", "[::]:9091", "10.0.0.5:9091", "admin.example:9091"):
        msg = problems({**UP, "RJ_ADMIN_ADDR": addr})
        line = next(ln for ln in msg.splitlines() if "RJ_ADMIN_KEYS" in ln)
        assert "RJ_ADMIN_ADDR" in line and "loopback" in line
    s = load_settings({**UP, "RJ_ADMIN_ADDR": "0.0.0.0:9091", "RJ_ADMIN_KEYS": "a1,, a2 ,", "RJ_API_KEYS": "c1"})
    assert (s.admin_keys, s.api_keys, s.admin_port) == (["a1", "a2"], ["c1"], 9091)
    # still reported next to an unrelated bad value
    msg = problems({**UP, "RJ_ADMIN_ADDR": "0.0.0.0:9091", "RJ_ROUTE_ALPHA": "x"})
    assert "RJ_ADMIN_KEYS" in msg and "RJ_ROUTE_ALPHA='x'" in msg

"""`ramjet replay`: session keys, the cache and queue models, the placement parser, journal loading, and a
journal recorded by the real balancer in front of the real simulator, replayed."""

from __future__ import annotations

import orjson
import pytest
from harness import chat_body, stack

from ramjet.balancer.proxy.journal import Journal
from ramjet.cli import main
from ramjet.demo.sessions import run_sessions
from ramjet.replay.cache import CacheModel, cached_tokens
from ramjet.replay.decisions import make_router
from ramjet.replay.figures import Model, stickiness
from ramjet.replay.journal import JournalError, Request, load_journal
from ramjet.replay.placements import PlacementError, parse_placements
from ramjet.replay.prefill import busiest_share, percentile, prefill_waits
from ramjet.replay.run import replay
from ramjet.routing.fingerprint import Fingerprint, fingerprint
from ramjet.routing.policy import Params
from ramjet.routing.sessions import SessionKeys

# --- session keys ------------------------------------------------------------


@pytest.mark.unit
def test_a_conversation_keeps_its_key_and_a_new_one_is_keyed_by_its_own_last_hash():
    keys = SessionKeys()
    harness = [1, 2, 3]
    a1, b1 = keys.key(harness + [10]), keys.key(harness + [20])
    assert (a1, b1) == (10, 20)  # two sessions of one harness: two conversations
    assert keys.key(harness + [10, 11, 12]) == a1  # the next turn extends the first
    assert keys.key(harness + [10, 11, 12, 13]) == a1
    assert keys.key(harness + [20, 21]) == b1
    assert keys.key(harness + [10, 11, 12]) == a1  # a retry of an earlier turn
    assert keys.key(harness + [30]) == 30 and keys.key([]) == 0


@pytest.mark.unit
def test_the_depth_a_chain_continues_an_earlier_one_at():
    keys = SessionKeys()
    keys.key([1, 2, 3, 10])
    assert keys.continued_depth([1, 2, 3, 10, 11, 12]) == 4  # ends where the answered prompt ended
    assert keys.continued_depth([1, 2, 3, 20]) == 0  # leaves it after the shared harness: a new conversation
    assert keys.continued_depth([1, 2, 3, 20]) == 0 and len(keys) == 1  # asking changes nothing


@pytest.mark.unit
def test_session_keys_remember_a_bounded_number_of_chain_ends():
    keys = SessionKeys(capacity=2)
    keys.key([1])
    keys.key([2])
    keys.key([3])  # forgets [1], the least recently used
    assert len(keys) == 2
    assert keys.key([1, 4]) == 4  # the conversation of [1] was forgotten: a new one
    assert keys.key([3, 5]) == 3
    with pytest.raises(ValueError):
        SessionKeys(capacity=0)


# --- the cache model and the queue model -------------------------------------


def fp(blocks: list[int], size: int = 100) -> Fingerprint:
    return Fingerprint(blocks, [size * (i + 1) for i in range(len(blocks))], size * len(blocks))


def request(chain: list[int], session: int = 0, prompt_tokens: int | None = 100, ts: float = 0.0,
            duration_s: float = 0.5) -> Request:
    return Request(ts, fp(chain), session, [0.0, 0.0], [True, True], 0, 0.01, duration_s, prompt_tokens, 0, False)


@pytest.mark.unit
def test_cached_tokens_count_what_requests_still_running_pin():
    first, second = request([1, 2], ts=0.0, duration_s=10.0), request([3], ts=1.0)
    third = request([1, 2], ts=2.0, prompt_tokens=1000)
    # over capacity from the first request on, but the first runs until t=10: its 200 bytes stay
    assert cached_tokens([first, second, third], [0, 0, 0], 1, capacity_bytes=100, per_byte=1.0) == [0, 0, 200]


def serve(cache: CacheModel, replica: int, chain: list[int]) -> int:
    """A request that starts and ends before the next one."""
    found = cache.admit(replica, fp(chain))
    cache.release(replica, fp(chain))
    return found


@pytest.mark.unit
def test_a_replica_finds_the_leading_blocks_it_holds_and_then_holds_the_chain():
    cache = CacheModel(2, capacity_bytes=1000)
    assert serve(cache, 0, [1, 2, 3]) == 0
    assert serve(cache, 0, [1, 2, 3, 4]) == 300
    assert serve(cache, 0, [1, 9, 3]) == 100  # hashes name prefixes: a changed block ends the match
    assert serve(cache, 1, [1, 2]) == 0  # replicas cache alone


@pytest.mark.unit
def test_eviction_trims_conversations_from_the_tail_and_keeps_the_shared_head():
    cache = CacheModel(1, capacity_bytes=500)
    serve(cache, 0, [1, 2, 3])
    serve(cache, 0, [1, 7, 8])  # 5 blocks held: full
    serve(cache, 0, [1, 5])  # 6 blocks: the least recent (the tail of [1, 2, 3]) goes
    assert serve(cache, 0, [1, 2, 3]) == 200
    assert serve(cache, 0, [1, 5]) == 200  # the shared head stayed hot throughout


@pytest.mark.unit
def test_blocks_of_running_requests_are_never_evicted():
    cache = CacheModel(1, capacity_bytes=300)
    assert cache.admit(0, fp([1, 2, 3])) == 0  # runs on
    serve(cache, 0, [4, 5, 6])  # over capacity, but only its own blocks are evictable once it ends
    assert cache.admit(0, fp([1, 2, 3, 7])) == 300  # the running request's chain is still there
    assert serve(cache, 0, [4, 5, 6]) == 0


@pytest.mark.unit
def test_cached_tokens_convert_bytes_and_never_exceed_the_prompt():
    requests = [request([1, 2], ts=0.0, prompt_tokens=50), request([1, 2, 3], ts=1.0, prompt_tokens=60),
                request([1, 2, 3, 4], ts=2.0)]
    assert cached_tokens(requests, [0, 0, None], 1, 10_000, per_byte=0.5) == [0.0, 60, 0.0]  # 100 tokens, capped
    assert cached_tokens(requests, [0, 0, None], 1, 10_000, per_byte=0.2) == [0.0, 40.0, 0.0]
    assert cached_tokens(requests, [0, 1, None], 2, 10_000, per_byte=0.2) == [0.0, 0.0, 0.0]


@pytest.mark.unit
def test_prefill_waits_queue_first_come_first_served_per_replica():
    assert prefill_waits([0, 1, 2, 2], [0, 0, 1, 0], [4, 1, 1, 1], 2) == [0, 3, 0, 3]
    assert busiest_share([0, 0, 1], [3, 1, 2], 2) == pytest.approx(4 / 3)
    assert busiest_share([0], [0.0], 2) is None
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == pytest.approx(9.1) and percentile([], 90) is None


@pytest.mark.unit
def test_stickiness_counts_consecutive_served_turns_of_one_session():
    requests = [request([1], 1), request([2], 2), request([1, 3], 1), request([1, 3, 4], 1), request([2, 5], 2)]
    assert stickiness(requests, [0, 1, 0, 2, 1], [True] * 5) == pytest.approx(2 / 3)
    assert stickiness(requests, [0, 1, 0, 2, 1], [True, True, True, False, False]) == 1.0
    assert stickiness(requests, [0, 1, None, None, None], [True] * 5) is None


# --- placements --------------------------------------------------------------


@pytest.mark.unit
def test_placements_parse_names_and_settings():
    ps = parse_placements("relative,load,relative:alpha=2,cap=16,new_sessions=balance,load_unit_bytes=16384,ttft")
    assert [p.label for p in ps] == ["relative", "load",
                                     "relative:alpha=2,cap=16,new_sessions=balance,load_unit_bytes=16384", "ttft"]
    tuned = ps[2]
    assert tuned.params(Params()) == Params(alpha=2.0, cap_blocks=16, load_unit_bytes=16384)
    assert tuned.new_sessions("affinity") == "balance" and ps[0].new_sessions("affinity") == "affinity"
    assert parse_placements("absolute:index_capacity=5")[0].index_capacities([9, 9]) == [5, 5]


@pytest.mark.unit
@pytest.mark.parametrize(("text", "message"), [
    ("", "no placement given"),
    ("nearest", "unknown policy 'nearest'"),
    ("alpha=2,relative", "comes before any policy name"),
    ("relative:alpha=-1", "alpha must be a finite number >= 0"),
    ("relative:cap=1.5", "cap must be an integer >= 1"),
    ("relative:chunk_bytes=4096", "unknown setting 'chunk_bytes'"),
    ("relative:cap=8,cap=9", "cap given twice"),
    ("relative:new_sessions=spread", "new_sessions must be one of affinity, balance"),
    ("relative,,load", "empty item"),
    ("relative:alpha", "expected key=value"),
])
def test_placements_are_parsed_strictly(text, message):
    with pytest.raises(PlacementError, match=message):
        parse_placements(text)


# --- loading -----------------------------------------------------------------


def record(ts: float = 0.0, chain=(1,), session: int | None = None, answered: bool = True, replica: int = 0,
           usage=(100, 0), replicas: int = 2, ttfb_ms: float = 10.0, duration_ms: float = 20.0) -> dict:
    """A journal record as outcome.py writes it (only the fields a replay reads, and the tie-break key)."""
    chain = list(chain)
    return {"ts": ts, "blocks": len(chain), "prompt_bytes": 100 * len(chain), "chain": [f"{h:016x}" for h in chain],
            "sizes": [100] * len(chain), "session": f"{chain[0] if session is None else session:016x}",
            "tiebreak": f"{chain[-1]:016x}", "loads": [0.0] * replicas, "serving": [True] * replicas,
            "policy": "relative", "attempts": [{"upstream": replica, "status": 200 if answered else 502}],
            "ttfb_ms": ttfb_ms if answered else None, "duration_ms": duration_ms,
            "usage": None if usage is None else {"prompt_tokens": usage[0], "cached_tokens": usage[1],
                                                 "completion_tokens": 1}}


HEADER = {"journal": 1, "policy": "relative", "params": {"alpha": 2.0}, "replicas": 2, "index_capacities": [50, 50],
          "max_prefix_bytes": 2097152, "new_sessions": "affinity"}


def write_journal(path, lines: list) -> str:
    path.write_bytes(b"".join((line if isinstance(line, bytes) else orjson.dumps(line)) + b"\n" for line in lines))
    return str(path)


@pytest.mark.unit
def test_loading_orders_by_arrival_and_rebuilds_fingerprints(tmp_path):
    path = write_journal(tmp_path / "j.jsonl", [record(ts=2.0, chain=[5, 6]), b"", record(ts=1.0, chain=[5])])
    recording = load_journal(path)
    assert [r.ts for r in recording.requests] == [1.0, 2.0]
    assert recording.requests[1].fingerprint == Fingerprint([5, 6], [100, 200], 200)
    assert recording.index_capacities is None and recording.policy == "relative" and recording.replicas == 2
    assert any("no header" in note for note in recording.notes)


@pytest.mark.unit
@pytest.mark.parametrize(("lines", "message"), [
    ([b"{not json"], "line 1: not JSON"),
    ([record(), b"[1, 2]"], "line 2: expected a JSON object"),
    ([{"ts": 1.0, "blocks": 3, "prompt_bytes": 9, "overlaps": [0, 0]}], "line 1: the record has no block chain"),
    ([], "no routing decisions"),
    ([record(usage=None)], "no request carries engine-reported usage"),
    ([record(), record(replicas=3)], r"does not fit 2 replicas \(3 loads"),
    ([record(), record(replica=2)], "does not fit 2 replicas"),
    ([{**record(), "sizes": [100, 100]}], "line 1: bad record"),
    ([{**record(), "chain": ["xyz"]}], "line 1: bad record"),
    ([{k: v for k, v in record().items() if k != "session"}], "line 1: the record has no 'session'"),
    ([{"journal": 99}], "journal format 99"),
    ([HEADER, record(), {**HEADER, "policy": "absolute"}], "line 3: a header with other routing settings"),
    ([{**HEADER, "params": {"alpha": "2"}}], "bad header: params must map"),
    ([{"journal": 1, "policy": "nearest"}], "bad header: policy 'nearest'"),
    ([{**HEADER, "host_capacities": [10]}], "bad header: host_capacities must list one integer"),
    ([{**HEADER, "host_credit": 2}], "bad header: host_credit must be a number from 0 to 1"),
    ([{**HEADER, "idle_decode_units": "2"}], "bad header: idle_decode_units must be a number from 0 to 64"),
])
def test_journal_errors_name_the_line_and_the_cause(tmp_path, lines, message):
    with pytest.raises(JournalError, match=message):
        load_journal(write_journal(tmp_path / "j.jsonl", lines))


@pytest.mark.unit
def test_a_journal_recorded_with_the_idle_decode_term_says_the_replay_does_not_weigh_it(tmp_path):
    recording = load_journal(write_journal(tmp_path / "j.jsonl", [{**HEADER, "idle_decode_units": 2.0}, record()]))
    assert recording.notes == ["recorded with a decoding request weighing 2 more load units while a rank was idle "
                               "(RJ_ROUTE_IDLE_DECODE_UNITS): the replay models no decoding, so it does not weigh them"]


@pytest.mark.unit
def test_a_header_gives_the_recording_settings_and_a_repeated_one_is_a_restart(tmp_path):
    recording = load_journal(write_journal(tmp_path / "j.jsonl", [HEADER, record(), HEADER, record(ts=1.0)]))
    assert recording.params == Params(alpha=2.0) and recording.index_capacities == [50, 50]
    assert recording.notes == ["1 later balancer start(s) in the journal: the replay keeps one router throughout"]
    assert recording.host_capacities is None and recording.host_credit == 1.0


@pytest.mark.unit
def test_a_recorded_host_tier_is_the_replayed_routers(tmp_path):
    """A balancer told of a host tier (RJ_ROUTE_HOST_TIER_TOKENS) keeps what its device pushes out and prices it
    as a reload: the replay's router must do the same to re-decide as it did."""
    header = {**HEADER, "host_capacities": [100, 100], "host_credit": 0.9}
    recording = load_journal(write_journal(tmp_path / "j.jsonl", [header, record()]))
    assert recording.host_capacities == [100, 100] and recording.host_credit == 0.9
    router = make_router(recording, parse_placements("relative")[0], recording.index_capacities)
    for start in range(0, 60, 6):  # 60 blocks through a device of 50: the oldest go to the host tier
        router.index.record(0, list(range(start + 1, start + 7)))
    assert router.host_credit == 0.9 and router.index.on_host([1, 2], [2, 0]) == {0: 2}


@pytest.mark.unit
def test_the_command_prints_a_table_or_json(tmp_path, capsys):
    path = write_journal(tmp_path / "j.jsonl", [HEADER, record(chain=[1, 2]), record(ts=1.0, chain=[1, 2, 3])])
    assert main(["replay", path, "--placements", "relative,load:alpha=0", "--loads", "recorded"]) == 0
    table = capsys.readouterr().out
    assert "| placement | cache % |" in table and "| relative * |" in table and "| load:alpha=0 |" in table
    assert main(["replay", path, path, "--placements", "relative", "--json", "--skip", "0.5"]) == 0
    reports = orjson.loads(capsys.readouterr().out)
    assert len(reports) == 2 and reports[0]["counted"] == 1 and reports[0]["requests"] == 2
    row = reports[0]["placements"][0]
    assert reports[0]["tokens_per_byte"] == pytest.approx(200 / 500)  # usage: 100 tokens each, for 200 and 300 bytes
    # the counted request finds its first 200 bytes cached: 80 of its 100 tokens
    assert row["recording"] and row["cache_ratio"] == pytest.approx(0.8) and row["agreement"] is None
    assert row["prompt_tokens"] == 100 and row["cached_tokens"] == pytest.approx(80)


@pytest.mark.unit
def test_a_missing_journal_or_bad_placement_exits_2_without_a_traceback(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "nope.jsonl"), "--placements", "relative"]) == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err
    path = write_journal(tmp_path / "j.jsonl", [record()])
    assert main(["replay", path, "--placements", "relative:alpha=x"]) == 2
    assert "alpha must be" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["replay", path, "--placements", "relative", "--time-scale", "0"])
    assert e.value.code == 2 and "expected a number > 0" in capsys.readouterr().err


@pytest.mark.unit
def test_journal_writes_never_raise(tmp_path, caplog):
    journal = Journal(tmp_path / "j.jsonl", header={"journal": 1})
    journal.close()
    journal.write({"ts": 1.0})  # closed: the line is lost, the request is not
    journal.write({"bad": object()})
    assert "lines are being lost" in caplog.text
    assert (tmp_path / "j.jsonl").read_bytes() == b'{"journal":1}\n'


# --- a journal recorded by the real balancer, replayed --------------------------------


async def record_live(path, basis: str, sessions: int = 8, turns: int = 5):
    """Agent-like sessions through the balancer (in process, 8 ranks, engine 1000x real time), journal on."""
    # the idle decode term off: it weighs decoding, which the replay does not model (a note, tested below)
    async with stack(route_journal=str(path), route_affinity_basis=basis, route_idle_decode_units="0") as s:
        b = s.balancer
        text = "one known prompt " * 200
        assert (await s.chat(text)).status_code == 200
        report = await run_sessions("http://ramjet", sessions=sessions, turns=turns, transport=s.transport,
                                    harness_bytes=20_000, task_bytes=2_000, turn_bytes=3_000, tool_s=0.05)
        assert report.failures == 0
        return b.settings


@pytest.mark.e2e
async def test_a_live_journal_replays_to_the_recorded_choices_and_ranks_affinity_above_load(tmp_path):
    path = tmp_path / "journal.jsonl"
    settings = await record_live(path, "relative")
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert lines[0]["journal"] == 1 and lines[0]["policy"] == "relative" and len(lines) == 1 + 1 + 8 * 5
    assert b"one known prompt" not in path.read_bytes()
    recording = load_journal(path)
    known = fingerprint("chat", chat_body("one known prompt " * 200), settings.route_chunk_bytes,
                        settings.route_max_prefix_bytes)
    assert recording.requests[0].fingerprint == known  # the record rebuilds the router's fingerprint exactly
    sessions = {r.session for r in recording.requests[1:]}
    assert len(sessions) == 8  # 8 conversations on one harness: 8 keys, each turn in its own
    assert not recording.notes

    model = Model(time_scale=1000.0)
    placements = parse_placements("relative,load")
    same = replay(recording, placements, model, "recorded")
    relative, load = same.placements
    assert relative.recording and relative.agreement == 1.0
    assert abs(relative.cache_ratio - same.recorded.cache_ratio) < 0.03
    own = replay(recording, placements, model, "replayed")
    relative, load = own.placements
    assert relative.cache_ratio > load.cache_ratio + 0.05 and relative.stickiness > load.stickiness

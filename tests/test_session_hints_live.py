"""Session hints through the balancer (in process): keyed conversations keep their rank, the key is kept only
hashed (journal, logs, metrics, operator API), explain is the live decision with a key, odd keys are ignored
rather than refused, and a journal recorded with keys replays with them."""

from __future__ import annotations

import logging

import orjson
import pytest

from harness import chat_body, stack
from ramjet.balancer.edge.admin import build_admin_app
from ramjet.replay.figures import Model
from ramjet.replay.journal import load_journal
from ramjet.replay.placements import parse_placements
from ramjet.replay.run import replay

pytestmark = pytest.mark.e2e

SECRET = "conv-SECRET-KEY-4f1d"          # what a client sends; never to be seen again
HEADER_SECRET = "gw-SECRET-SESSION-77aa"


def admin_client(s):
    import httpx
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_admin_app(s.balancer)), base_url="http://admin")


class Conversation:
    """An agent's conversation on a shared harness, one tool round per turn, keyed as given."""

    def __init__(self, name: str, key: dict | None = None, headers: dict | None = None):
        self.messages = [{"role": "system", "content": "shared harness " * 600},
                         {"role": "user", "content": f"{name}: the task " * 150}]
        self.key, self.headers, self.name, self.turn = key or {}, headers or {}, name, 0

    def body(self) -> dict:
        return {"model": "glm-5.3", "messages": self.messages, "max_tokens": 4, **self.key}

    async def send(self, s) -> int:
        r = await s.client.post("/v1/chat/completions", json=self.body(), headers=self.headers)
        assert r.status_code == 200, r.text
        self.messages = self.messages + [r.json()["choices"][0]["message"],
                                         {"role": "tool", "content": f"{self.name} result {self.turn} " * 100}]
        self.turn += 1
        return int(r.headers["x-ramjet-upstream"])


async def test_keyed_conversations_keep_their_rank_and_the_key_is_kept_only_hashed(tmp_path, caplog):
    journal = tmp_path / "journal.jsonl"
    caplog.set_level(logging.DEBUG)
    async with stack(route_journal=str(journal), session_header="x-session-id") as s, admin_client(s) as admin:
        convs = [Conversation(f"c{i}", key={"prompt_cache_key": f"{SECRET}-{i}"}) for i in range(5)]
        convs.append(Conversation("h", headers={"x-session-id": HEADER_SECRET}))
        homes = [[await c.send(s) for _ in range(4)] for c in convs]
        assert all(len(set(h)) == 1 for h in homes), homes
        explained = (await admin.post("/admin/explain", json=convs[0].body())).json()
        via_header = (await admin.post("/admin/explain", json=convs[-1].body(),
                                       headers={"x-session-id": HEADER_SECRET})).json()
        assert (explained["session_hint"], explained["reason"], explained["session_home"]) == ("home", "session",
                                                                                                homes[0][0])
        assert (via_header["session_hint"], via_header["pick"]) == ("home", homes[-1][0])
        metrics = (await s.client.get("/metrics")).text
        seen = [journal.read_text(), caplog.text, metrics, (await s.client.get("/health")).text,
                orjson.dumps(explained).decode(), orjson.dumps(via_header).decode(),
                (await admin.get("/admin/replicas")).text]
        assert await s.metric("ramjet_session_hints_total", use="unknown") == 6  # each conversation's first turn
        assert await s.metric("ramjet_session_hints_total", use="home") == 18
    assert all(SECRET not in t and HEADER_SECRET not in t for t in seen)
    records = [orjson.loads(line) for line in journal.read_bytes().splitlines()]
    assert records[0]["session_hints"] is True
    hints = [r["hint"] for r in records[1:]]
    assert all(len(h) == 16 for h in hints) and len(set(hints)) == 6  # one hashed key per conversation


async def test_explain_is_the_live_decision_when_a_key_is_present():
    async with stack() as s, admin_client(s) as admin:
        for i in range(6):
            c = Conversation(f"e{i}", key={"prompt_cache_key": f"explain-{i}"})
            for _ in range(3):
                explained = (await admin.post("/admin/explain", json=c.body())).json()
                assert await c.send(s) == explained["pick"], explained
        # a busy home: explain still says what the live path then does
        s.balancer.fleet.reserve(explained["pick"], 12.0).__enter__()
        explained = (await admin.post("/admin/explain", json=c.body())).json()
        assert explained["reason"] == "session" and await c.send(s) == explained["pick"]


@pytest.mark.parametrize("route, body, headers", [
    ("/v1/chat/completions", {"prompt_cache_key": 5}, {}),
    ("/v1/chat/completions", {"prompt_cache_key": {"nested": ["x"]}}, {}),
    ("/v1/chat/completions", {"prompt_cache_key": None}, {}),
    ("/v1/chat/completions", {"prompt_cache_key": "k" * 100_000}, {}),
    ("/v1/chat/completions", {"prompt_cache_key": "ok"}, {"x-session-id": b"\xff\xfe odd\tbytes \x80"}),
    ("/v1/chat/completions", {}, {"x-session-id": "h" * 4000}),
    ("/v1/messages", {"metadata": {"user_id": ["not", "a", "string"]}}, {}),
    ("/v1/messages", {"metadata": "user-1"}, {}),
])
async def test_an_odd_session_key_is_ignored_never_a_500(route, body, headers):
    """(A header value with control characters never reaches the app: the HTTP parser refuses it, 400 from
    edge/protocol.py; obs-text bytes do reach it, and are hashed as they are.)"""
    async with stack(session_header="x-session-id") as s, admin_client(s) as admin:
        payload = {**chat_body("odd keys"), **body}
        for _ in range(2):
            r = await s.client.post(route, json=payload, headers=headers)
            assert r.status_code == (404 if route == "/v1/messages" else 200), r.text  # the simulator has no
            assert r.headers.get("x-ramjet-upstream") is not None                    # Messages API: its 404
        e = await admin.post(f"/admin/explain?path={route}", json=payload, headers=headers)
        assert e.status_code == 200 and e.json()["session_hint"] in (None, "home", "hint")


async def test_a_journal_recorded_with_keys_replays_its_choices_with_hints_and_can_be_replayed_without(tmp_path):
    path = tmp_path / "journal.jsonl"
    async with stack(route_journal=str(path)) as s:
        convs = [Conversation(f"r{i}", key={"prompt_cache_key": f"replay-{i}"}) for i in range(8)]
        for _ in range(4):
            for c in convs:
                await c.send(s)
    recording = load_journal(path)
    assert recording.session_hints and all(r.hint for r in recording.requests)
    report = replay(recording, parse_placements("relative,relative:hints=off"), Model(time_scale=1000.0), "recorded")
    with_hints, without = report.placements
    assert with_hints.recording and with_hints.agreement == 1.0 and not without.recording
    assert "hints=on" in report.recording

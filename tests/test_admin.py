"""The operator API: replica state, drain for maintenance, routing explanations (in process)."""

from __future__ import annotations

import httpx
import pytest

from harness import all_precise, chat_body, precise_stack, stack
from poll import until
from ramjet.balancer.edge.admin import build_admin_app
from ramjet.demo.sessions import run_sessions

pytestmark = pytest.mark.e2e


def admin_client(s, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_admin_app(s.balancer)),
                             base_url="http://admin", headers=headers)


async def test_replicas_report_state_load_index_and_fence_history():
    async with stack() as s, admin_client(s) as admin:
        answered = await s.chat("x" * 5000)
        assert answered.status_code == 200
        served = int(answered.headers["x-ramjet-upstream"])
        blocks = (await admin.post("/admin/explain", json=chat_body("x" * 5000))).json()["blocks"]
        assert blocks > 1  # a long prompt: several blocks
        fenced = (served + 1) % 8  # another replica: what it remembers stays its own
        s.balancer.fleet.fence(fenced, "rank_error")
        report = (await admin.get("/admin/replicas")).json()
        assert report["policy"] == "relative" and len(report["replicas"]) == 8
        r = report["replicas"][fenced]
        assert r["state"] == "fenced" and r["reason"] == "rank_error"
        assert [e["event"] for e in r["history"]] == ["fenced"]
        # the replica that served the prompt remembers all of its blocks (and where the conversation ends), no
        # other replica any
        remembered = [x["index_blocks"] for x in report["replicas"]]
        assert remembered[served] >= blocks and remembered[:served] + remembered[served + 1:] == [0] * 7, remembered
        assert (await admin.get("/docs")).status_code == 200  # the OpenAPI page
        assert "/admin/explain" in (await admin.get("/openapi.json")).json()["paths"]


async def test_drain_moves_a_session_once_and_undrain_takes_new_ones():
    async with stack() as s, admin_client(s) as admin:
        messages = [{"role": "system", "content": "harness " * 2000}, {"role": "user", "content": "task " * 500}]

        async def turn() -> int:
            r = await s.client.post("/v1/chat/completions", json={"model": "glm-5.3", "messages": messages,
                                                                  "max_tokens": 4})
            assert r.status_code == 200
            messages.extend([r.json()["choices"][0]["message"], {"role": "tool", "content": "result " * 300}])
            return int(r.headers["x-ramjet-upstream"])

        home = await turn()
        assert await turn() == home
        drained = (await admin.post(f"/admin/replicas/{home}/drain")).json()
        assert drained["drained"] is True and drained["state"] == "serving"
        assert (await s.health())["status"] == "ok"  # drained is not unhealthy
        new_home = await turn()
        assert new_home != home
        assert (await admin.post(f"/admin/replicas/{home}/undrain")).json()["drained"] is False
        assert [await turn() for _ in range(3)] == [new_home] * 3  # it stays where its history now is
        # new sessions go where fewer live (docs/design.md): 24 of them, one after another, so that the replica
        # that hosted the moved session gets its share once the others caught up (a burst of first turns on one
        # new harness would instead go where that harness is already being read: docs/design.md, "Requests in
        # flight count as held on their replica")
        placed: set[str] = set()
        for k in range(24):
            fresh = await run_sessions("http://ramjet", sessions=1, first_session=k, turns=1, seed=7, tool_s=0,
                                       transport=s.transport)
            placed |= set(fresh.upstreams)
        assert str(home) in placed  # the undrained replica takes new sessions again
        assert (await admin.post("/admin/replicas/99/drain")).status_code == 404


async def test_explain_shows_the_pick_without_forwarding():
    async with stack() as s, admin_client(s) as admin:
        body = chat_body("the same long prompt " * 300)
        first = await s.client.post("/v1/chat/completions", json=body)
        home = int(first.headers["x-ramjet-upstream"])
        requests_before = s.engines[0].stats()["totals"]["requests"]
        r = await admin.post("/admin/explain", json=body)
        assert r.status_code == 200, r.text
        e = r.json()
        assert e["pick"] == home and e["reason"] == "affinity" and e["policy"] == "relative"
        assert "warmest" in e["policy_rule"]
        row = e["replicas"][home]
        assert row["overlap_blocks"] == e["blocks"] and row["credit"] == max(x["credit"] for x in e["replicas"])
        assert s.engines[0].stats()["totals"]["requests"] == requests_before  # nothing forwarded
        bad = await admin.post("/admin/explain", content=b"{not json")
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
        assert (await admin.post("/admin/explain?path=/v1/embeddings", json=body)).status_code == 400


async def test_explain_in_precise_mode_is_the_live_decision_where_the_approximate_index_is_wrong():
    """A conversation reached a rank behind the balancer's back: its engine reports the blocks, the approximate
    index knows nothing of them. Explain asks the same decision service as the live path, reports included."""
    async with precise_stack() as s, admin_client(s) as admin:
        await until(lambda: all_precise(s), "every replica synced")
        session = chat_body("remember this " * 600)
        guess = s.balancer.router.decide("chat", session, [0.0] * 8, [True] * 8).ranking.order[0]
        holder = (guess + 3) % 8
        direct = await s.engine_clients[0].post("/v1/chat/completions", json={**session, "routed_dp_rank": holder})
        assert direct.status_code == 200

        async def reported():
            return (await s.balancer.precise.match("chat", session)).held[holder].gpu_tokens > 1000
        await until(reported, "the engine's report of the holder's blocks")
        explained = (await admin.post("/admin/explain", json=session)).json()
        assert explained["pick"] == holder and explained["reason"] == "affinity"
        row = explained["replicas"][holder]
        assert row["held_by"] == "engine" and row["covered_bytes"] > 0 and row["overlap_blocks"] == 0
        for _ in range(3):  # asking changes nothing
            assert (await admin.post("/admin/explain", json=session)).json() == explained
        assert s.balancer.router.decide("chat", session, [0.0] * 8, [True] * 8).ranking.order[0] == guess
        live = await s.client.post("/v1/chat/completions", json=session)
        assert int(live.headers["x-ramjet-upstream"]) == holder


async def test_explain_in_approximate_mode_is_the_live_decision_for_new_and_continuing_sessions():
    async with stack() as s, admin_client(s) as admin:
        for k in range(6):
            body = chat_body(f"session {k} " * 800)
            for _ in range(2):  # a new conversation, then the same prompt again (continuing: its home now)
                explained = (await admin.post("/admin/explain", json=body)).json()
                live = await s.client.post("/v1/chat/completions", json=body)
                assert int(live.headers["x-ramjet-upstream"]) == explained["pick"], explained
                assert all(r["held_by"] == "approximate" for r in explained["replicas"])


async def test_admin_keys_are_required_when_set():
    async with stack(admin_keys="op-secret", api_keys="client-key") as s:
        async with admin_client(s) as anonymous:
            assert (await anonymous.get("/admin/replicas")).status_code == 401
        async with admin_client(s, "client-key") as client_key:  # a client key is not an admin key
            assert (await client_key.get("/admin/replicas")).status_code == 401
        async with admin_client(s, "op-secret") as operator:
            assert (await operator.get("/admin/replicas")).status_code == 200
    async with stack(admin_keys="op-secret") as s:
        assert (await s.client.get("/admin/replicas")).status_code == 404  # the client listener has no operator routes

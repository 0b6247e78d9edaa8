"""The dashboard's routes on the operator API, in process: the page, its poll, a recent request's decision."""

from __future__ import annotations

import dataclasses
import re

import httpx
import pytest

from harness import all_precise, chat_body, precise_stack, stack
from poll import until
from ramjet.balancer.edge.admin import build_admin_app

pytestmark = pytest.mark.e2e


def admin_client(s, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_admin_app(s.balancer)),
                             base_url="http://admin", headers=headers)


async def next_tick(s) -> int:
    """Wait for the sampler's next tick (one a second) and return it."""
    now = s.balancer.samples.ticks
    return await until(lambda: s.balancer.samples.ticks > now and s.balancer.samples.ticks, "the next sample",
                       timeout=10)


async def test_the_page_needs_no_key_and_its_data_does():
    async with stack(admin_keys="op-secret") as s, admin_client(s) as anonymous:
        page = await anonymous.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        for src in re.findall(r'(?:src|href)="([^"]+)"', page.text):  # everything it loads comes from here
            assert src.startswith("dashboard/") or src.startswith("data:"), src
            if src.startswith("dashboard/"):
                assert (await anonymous.get(f"/{src}")).status_code == 200
        assert (await anonymous.get("/admin/dashboard/state")).status_code == 401
        missing = await anonymous.get("/dashboard/secrets.txt")
        assert missing.status_code == 404 and "dashboard.js" in missing.json()["detail"]
        assert (await anonymous.get("/dashboard/")).status_code in (307, 308)  # one address for the page
        async with admin_client(s, "op-secret") as operator:
            assert (await operator.get("/admin/dashboard/state")).status_code == 200


async def test_a_poll_shows_every_replica_and_only_what_is_newer():
    async with stack() as s, admin_client(s) as admin:
        sent = [await s.chat(f"conversation {k} " * 300) for k in range(3)]
        assert all(r.status_code == 200 for r in sent)
        s.balancer.fleet.fence(5, "rank_error")
        s.balancer.fleet.drain(6)
        await next_tick(s)
        first = (await admin.get("/admin/dashboard/state")).json()
        assert first["status"] == "degraded" and first["serving"] == 7 and first["drained"] == 1
        rows = first["replicas"]
        assert [r["upstream"] for r in rows] == list(range(8))
        assert (rows[5]["state"], rows[5]["reason"], rows[6]["drained"]) == ("fenced", "rank_error", True)
        assert all(r["mode"] == "approximate" for r in rows)
        assert first["totals"]["requests"] == 3 and first["totals"]["fences"] == 1
        served = [int(r.headers["x-ramjet-upstream"]) for r in sent]
        assert [r["requests"] for r in rows] == [served.count(i) for i in range(8)]
        assert sum(x["requests"] for x in first["samples"]) == 3
        ids = {r.headers["x-ramjet-request-id"] for r in sent}
        assert {q["id"] for q in first["requests"]} == ids
        q = first["requests"][0]
        assert q["pick"]["upstream"] == q["upstream"] and q["runner_up"]["upstream"] != q["upstream"]
        assert q["pick"]["score"] == pytest.approx(q["pick"]["credit"] - q["alpha"] * q["pick"]["load_units"])
        # the next poll carries only what is newer: nothing yet, then the next second
        again = (await admin.get(f"/admin/dashboard/state?after={first['tick']}")).json()
        assert again["requests"] == [] and all(x["tick"] > first["tick"] for x in again["samples"])
        await next_tick(s)
        later = (await admin.get(f"/admin/dashboard/state?after={first['tick']}")).json()
        assert later["samples"] and later["requests"] == []
        # a cursor from before a restart (ahead of this balancer's ticks): everything again
        ahead = (await admin.get(f"/admin/dashboard/state?after={later['tick'] + 1000}")).json()
        assert ahead["samples"][0]["tick"] == 1 and len(ahead["samples"]) == ahead["tick"]
        assert len(ahead["requests"]) == 3


async def test_a_recent_request_is_explained_as_it_was_decided():
    async with stack() as s, admin_client(s) as admin:
        body = chat_body("the same long prompt " * 300)
        first = await s.client.post("/v1/chat/completions", json=body)
        home = int(first.headers["x-ramjet-upstream"])
        again = await s.client.post("/v1/chat/completions", json=body)
        await next_tick(s)
        e = (await admin.get(f"/admin/dashboard/requests/{again.headers['x-ramjet-request-id']}")).json()
        assert e["pick"] == home and e["reason"] == "affinity" and e["upstream"] == home
        assert len(e["replicas"]) == 8 and e["replicas"][home]["overlap_blocks"] == e["blocks"]
        now = (await admin.post("/admin/explain", json=body)).json()  # the same shape as explaining it now
        assert set(now) - set(e) == {"path"} and now["pick"] == home
        kept = s.balancer.samples.find(again.headers["x-ramjet-request-id"])
        assert kept is not None and not any("long prompt" in t for t in strings(kept))  # no prompt text is kept


def strings(value, depth: int = 0) -> list[str]:
    """Every string reachable from a dataclass, list, tuple or dict."""
    if depth > 8:
        return []
    if isinstance(value, str):
        return [value]
    if dataclasses.is_dataclass(value):
        return [t for f in dataclasses.fields(value) for t in strings(getattr(value, f.name), depth + 1)]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in strings(k, depth + 1) + strings(v, depth + 1)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in strings(v, depth + 1)]
    return []


async def test_bad_input_gets_a_clear_4xx_json_error():
    async with stack() as s, admin_client(s) as admin:
        for query in ("after=-1", "after=soon", "after=1e3"):
            r = await admin.get(f"/admin/dashboard/state?{query}")
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "after"], r.text
        for bad in ("a%20b", "x" * 65, "..%2F..%2Fetc"):
            r = await admin.get(f"/admin/dashboard/requests/{bad}")
            assert 400 <= r.status_code < 500 and r.headers["content-type"] == "application/json", (bad, r.text)
        r = await admin.get("/admin/dashboard/requests/abc-1")
        assert r.status_code == 404 and "not among the last" in r.json()["detail"]
        for method, path in (("POST", "/dashboard"), ("DELETE", "/dashboard/dashboard.js"),
                             ("POST", "/admin/dashboard/state")):
            r = await admin.request(method, path)
            assert r.status_code == 405 and r.json()["detail"] == "Method Not Allowed", (method, path)


async def test_precise_mode_rows_show_each_rank_s_mode_and_the_blocks_its_engine_reports():
    async with precise_stack() as s, admin_client(s) as admin:
        await until(lambda: all_precise(s), "every replica synced")
        answered = await s.chat("remember this " * 600)
        home = int(answered.headers["x-ramjet-upstream"])

        async def reported():
            rows = (await admin.get("/admin/dashboard/state")).json()["replicas"]
            return rows[home]["kv"]["gpu_blocks"] and rows
        rows = await until(reported, "the engine's report of the blocks it holds")
        assert all(r["mode"] == "precise" and r["mode_reason"] is None for r in rows)
        assert rows[home]["kv"]["host_blocks"] == 0 and rows[home]["kv"]["block_size"] > 0
        state = (await admin.get("/admin/dashboard/state")).json()
        assert state["precise"] == 8

"""The dashboard in a real browser: `ramjet serve` and `ramjet sim` as processes, headless Chromium on the page.

What an operator sees: the page asks for the admin key, then shows every rank as the operator API
reports it and the requests a few agent sessions sent; a rank wedged in the simulator turns fenced
on the page by itself; Drain asks for confirmation and drains. The page fetches nothing but its own
listener, and never puts the key in a URL. The screenshot is kept in the test's directory; with
RAMJET_DASHBOARD_SCREENSHOT=docs/dashboard.png it is also written there (README's picture):

    RAMJET_DASHBOARD_SCREENSHOT=docs/dashboard.png python -m pytest -q tests/test_dashboard_page.py
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from browser import chromium, find_chromium
from ramjet.bench import procs
from ramjet.demo.sessions import run_sessions

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

KEY = "operator-secret-7f3a"
SESSIONS, TURNS = 4, 3
PROBING = dict(upstream_rank_probe="on", health_interval_ms="300", health_timeout_ms="1000",
               upstream_rank_probe_timeout_ms="300", liveness_window_ms="200")


def row(upstream: int, cell: str) -> str:
    """JavaScript: the text of one cell of a replica's row."""
    return f"(document.querySelector('#replicas tr[data-upstream=\"{upstream}\"] td.{cell}') || {{}}).textContent"


@pytest.fixture
def browser_needed():
    if find_chromium() is None:
        pytest.skip("no Chromium to drive: install Debian's `chromium` package (apt-get install chromium; "
                    ".ci/run does), or name a Chromium binary in RAMJET_CHROMIUM")


async def test_the_dashboard_shows_every_rank_a_fence_and_drains(browser_needed, start_sim, start_balancer, tmp_path):
    sim, _ = start_sim("--dp-size", "8", "--time-scale", "1000", env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"})
    admin = f"http://127.0.0.1:{procs.free_port()}"
    url, _ = start_balancer(upstream=sim, upstream_dp_size="8", admin_addr=admin.removeprefix("http://"),
                            admin_keys=KEY, **PROBING)
    report = await run_sessions(url, sessions=SESSIONS, turns=TURNS, harness_bytes=20_000, tool_s=0.02)
    assert report.failures == 0
    async with httpx.AsyncClient(base_url=admin, headers={"Authorization": f"Bearer {KEY}"}) as api, \
            chromium(tmp_path) as page:
        truth = (await api.get("/admin/replicas")).json()["replicas"]
        await page.goto(f"{admin}/dashboard")
        # the page asks for the key, and shows nothing until it has it
        await page.wait("!document.getElementById('key-form').hidden", "the page asks for the admin key")
        assert await page.evaluate("document.querySelectorAll('#replicas tbody tr').length") == 0
        await page.type_into("#key-input", KEY)
        await page.click("#key-form button[type=submit]")
        await page.wait("document.querySelectorAll('#replicas tbody tr').length === 8", "8 replica rows")
        assert await page.evaluate("getComputedStyle(document.getElementById('key-form')).display") == "none"
        for r in truth:  # every rank, as the operator API reports it
            assert r["state"] == "serving"
            text = await page.evaluate(f"document.querySelector('#replicas tr[data-upstream=\"{r['upstream']}\"]')"
                                       ".textContent")
            assert f"rank {r['rank']}" in text and "serving" in text and "approximate" in text, text
        # every turn the sessions sent, counted on the rank that answered it, once a sample folded them in
        served = "[...document.querySelectorAll('#replicas td.requests .v')].map(c => parseInt(c.textContent))"
        await page.wait(f"{served}.reduce((a, b) => a + b, 0) === {report.turns}", "every turn counted on its rank")
        per_rank = await page.evaluate(served)
        assert {str(i): n for i, n in enumerate(per_rank) if n} == report.upstreams
        await page.wait("document.querySelectorAll('#requests tbody tr').length > 0", "recent requests listed")
        newest = await page.evaluate("document.querySelector('#requests tbody tr').dataset.id")
        answered_by = await page.evaluate("document.querySelector('#requests tbody tr td.replica').textContent")
        await page.click("#requests tbody tr button.explain")
        await page.wait("document.getElementById('explain').open", "the explanation opens")
        explanation = await page.evaluate("document.getElementById('explain-content').textContent")
        assert f"Pick {answered_by[:2]}" in explanation and newest in await page.evaluate(
            "document.getElementById('explain-title').textContent")
        assert await page.evaluate("document.querySelectorAll('#explain-table tbody tr').length") == 8
        await page.evaluate("document.getElementById('explain').close()")

        # a wedged rank: the balancer's rank probe fences it, and the page shows it without a reload
        home = int(report.routes[0][-1])  # session 0's rank
        assert (await httpx.AsyncClient().post(f"{sim}/sim/faults", json={"rank": home, "mode": "wedge"})
                ).status_code == 200
        await page.wait(f"{row(home, 'state')}.includes('fenced')", f"rank {home} fenced on the page", timeout=30)
        assert "rank_timeout" in await page.evaluate(row(home, "state"))
        for r in truth:
            if r["upstream"] != home:
                assert "serving" in await page.evaluate(row(r["upstream"], "state"))
        assert "degraded" == await page.evaluate("document.getElementById('status').textContent")
        await page.wait("document.querySelector('[data-card=fences] .v').textContent === '1 / 1'",
                        "the fence counted: 1 fenced now, 1 fence since start")

        # Drain, after a confirmation
        other = (home + 1) % 8
        await page.click(f"#replicas tr[data-upstream='{other}'] button.drain")
        assert page.dialogs and f"Drain replica {other}" in page.dialogs[-1]
        await page.wait(f"{row(other, 'state')}.includes('drained')", f"replica {other} drained on the page")
        assert (await api.get("/admin/replicas")).json()["replicas"][other]["drained"] is True
        await page.wait(f"!!document.querySelector('#replicas tr[data-upstream=\"{other}\"] button.undrain')",
                        "an Undrain button in its place")

        await page.screenshot(tmp_path / "dashboard.png")
        if target := os.environ.get("RAMJET_DASHBOARD_SCREENSHOT"):
            shutil.copyfile(tmp_path / "dashboard.png", Path(target))
        # nothing from anywhere but the operator listener, and the key in no URL
        assert page.requested and all(u.startswith(admin + "/") or u.startswith("data:") for u in page.requested), \
            json.dumps(page.requested)
        assert not any(KEY in u for u in page.requested)
        assert page.errors == []

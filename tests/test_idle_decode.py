"""RJ_ROUTE_IDLE_DECODE_UNITS (default 2): while a rank is idle, a turn does not join a rank busy decoding (in process).

The rule (routing/units.py, `with_idle_decode`) goes through the one decision service, so
the operator API's explain shows what a request would really get: here a rank's
decoding request is made by holding a reservation past its first byte, as the proxy does.
"""

from __future__ import annotations

import contextlib

import pytest

from harness import chat_body, stack
from test_admin import admin_client

pytestmark = pytest.mark.e2e

BODY = chat_body("a young conversation " * 400)


@contextlib.contextmanager
def decoding(fleet, ranks):
    """One request of this balancer's past its first byte (decoding) on each of `ranks`."""
    with contextlib.ExitStack() as held:
        for i in ranks:
            held.enter_context(fleet.reserve(i, 1.0)).prefill_done()
        yield


async def pick(admin) -> dict:
    r = await admin.post("/admin/explain", json=BODY)
    assert r.status_code == 200, r.text
    return r.json()


async def test_by_default_a_turn_leaves_a_rank_busy_decoding_for_an_idle_one_and_stays_when_every_rank_is_busy():
    async with stack() as s, admin_client(s) as admin:  # the default: 2 units
        home = int((await s.client.post("/v1/chat/completions", json=BODY)).headers["x-ramjet-upstream"])
        assert (await pick(admin))["pick"] == home
        with decoding(s.balancer.fleet, [home, home, *range(8)]):  # no rank idle: the term stays out
            assert (await pick(admin))["pick"] == home
        with decoding(s.balancer.fleet, [home]):
            moved = await pick(admin)
            rows = moved["replicas"]
            assert moved["pick"] != home and rows[home]["load_units"] > 2 > rows[moved["pick"]]["load_units"]
            live = await s.client.post("/v1/chat/completions", json=BODY)
            assert int(live.headers["x-ramjet-upstream"]) == moved["pick"]  # explain is the live decision

async def test_with_the_term_off_a_turn_stays_on_its_rank_while_it_decodes_another():
    async with stack(route_idle_decode_units="0") as s, admin_client(s) as admin:
        home = int((await s.client.post("/v1/chat/completions", json=BODY)).headers["x-ramjet-upstream"])
        with decoding(s.balancer.fleet, [home]):
            assert (await pick(admin))["pick"] == home

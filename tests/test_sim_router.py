"""Peer check: the SGLang router (sglang-router 0.3.2, cache_aware, --dp-aware) in front of `ramjet sim`."""

import asyncio

import httpx
import pytest
from sim_helpers import filler

from ramjet.demo.procs import free_port, sglang_router_binary, start_sglang_router, start_sim


@pytest.fixture
def router_and_sim(tmp_path):
    # part of the dev extra that CI installs: missing means a broken environment, so fail, never skip
    assert sglang_router_binary() is not None, \
        "sglang-router is not installed: pip install -e '.[dev]' (the dev extra pins sglang-router==0.3.2)"
    sim_port, router_port = free_port(), free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    sim = start_sim(sim_port, "--time-scale", "200", log_path=tmp_path / "sim.log")
    try:
        router = start_sglang_router(router_port, [sim_url], log_path=tmp_path / "router.log", timeout=40)
    except BaseException:
        sim.stop()
        raise
    try:
        yield f"http://127.0.0.1:{router_port}", sim_url, router
    finally:
        router.stop()
        sim.stop()


async def test_sglang_router_dp_aware_reaches_several_ranks(router_and_sim):
    router_url, sim_url, _ = router_and_sim
    async with httpx.AsyncClient(base_url=router_url, timeout=30) as c:
        # Concurrent distinct prompts: with nothing cached, cache_aware sends each to the least loaded rank.
        replies = await asyncio.gather(*[c.post("/v1/chat/completions", json={
            "model": "glm-5.3", "max_tokens": 2000, "ignore_eos": True,
            "messages": [{"role": "user", "content": filler(2_000, 500 + i)}]}) for i in range(12)])
        assert all(r.status_code == 200 for r in replies), [r.text[:200] for r in replies]
        repeat = {"model": "glm-5.3", "max_tokens": 2, "messages": [{"role": "user", "content": filler(4_000, 7)}]}
        await c.post("/v1/chat/completions", json=repeat)
        again = (await c.post("/v1/chat/completions", json=repeat)).json()
    loads = httpx.get(f"{sim_url}/v1/loads").json()["loads"]
    stats = httpx.get(f"{sim_url}/sim/stats").json()["ranks"]
    served = [s["dp_rank"] for s in stats if s["completed"]]
    assert len(loads) == 8 and len(served) > 1, stats
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 3_000  # cache-aware: same rank again

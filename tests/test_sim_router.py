"""Peer check: the SGLang router (sglang-router 0.3.2, cache_aware, --dp-aware) in front of `ramjet sim`."""

import asyncio
import time

import httpx
import pytest
from sim_helpers import filler

from ramjet.procs import ManagedProcess, free_port, sglang_router_binary, start_sim


@pytest.fixture
def router_and_sim(tmp_path):
    binary = sglang_router_binary()
    if binary is None:
        pytest.skip("sglang-router is not installed (pip install sglang-router==0.3.2, part of the dev extra)")
    sim_port, router_port = free_port(), free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    sim = start_sim(sim_port, "--time-scale", "200", log_path=tmp_path / "sim.log")
    router = ManagedProcess("sglang-router", [
        binary, "launch", "--worker-urls", sim_url, "--policy", "cache_aware", "--dp-aware",
        "--host", "127.0.0.1", "--port", str(router_port), "--prometheus-port", str(free_port()),
        "--prometheus-host", "127.0.0.1", "--log-level", "warn"], log_path=tmp_path / "router.log").start()
    try:
        yield f"http://127.0.0.1:{router_port}", sim_url, router
    finally:
        router.stop()
        sim.stop()


def wait_until_routing(router_url: str, router: ManagedProcess, timeout: float = 40.0) -> None:
    """The router answers /health before it has registered workers; wait for a real completion."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if not router.alive():
            pytest.fail(f"sglang-router exited; {router.tail()}")
        try:
            r = httpx.post(f"{router_url}/v1/chat/completions", timeout=5, json={
                "model": "glm-5.3", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1})
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(0.25)
    pytest.fail(f"sglang-router never routed a request ({last}); {router.tail()}")


async def test_sglang_router_dp_aware_reaches_several_ranks(router_and_sim):
    router_url, sim_url, router = router_and_sim
    wait_until_routing(router_url, router)
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

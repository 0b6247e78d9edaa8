"""KV cache events and load published by `ramjet sim` in SGLang's and vLLM's wire formats, and its tokenizer.

The clients here are plain pyzmq + msgpack (SUB for the live stream, DEALER for
replay), not the balancer's code. Every wait is on a condition with a bound
that only stops a hung test; only 127.0.0.1 is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import shutil
import socket
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio
from poll import until
from sim_helpers import chat, filler, sim_client

from ramjet.bench.procs import start_sim
from ramjet.sim.kv_wire import wire
from ramjet.sim.tokens import SHIPPED_DIR, load_tokenizer

PAGE = 16
BOUND_S = 20.0
HOST_MEDIUM = {"sglang": "CPU_PINNED", "vllm": "CPU"}
STORED_KEYS = {"sglang": ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"],
               "vllm": ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]}
both = pytest.mark.parametrize("fmt", ["sglang", "vllm"])


def free_ports(n: int) -> int:
    """A base port with `n` consecutive free ports on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for p in range(base, base + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise AssertionError("no run of free ports on 127.0.0.1")


def events_config(fmt: str, base: int, buffer_steps: int = 10_000) -> str:
    """Ranks publish at base + r, replay at base + 2 + r (two ranks)."""
    cfg = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{base}", "replay_endpoint": f"tcp://127.0.0.1:{base + 2}",
           "topic": "kv", "buffer_steps": buffer_steps}
    return json.dumps({**cfg, "enable_kv_cache_events": True} if fmt == "vllm" else cfg)


@contextlib.asynccontextmanager
async def publishing(fmt: str, base: int, buffer_steps: int = 10_000, **settings):
    async with sim_client(dp_size=2, page_tokens=PAGE, kv_events_config=events_config(fmt, base, buffer_steps),
                          kv_events_format=fmt, **settings) as (client, engine):
        yield client, engine


@pytest.fixture
async def zctx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def bounded(awaitable, what: str):
    try:
        return await asyncio.wait_for(awaitable, BOUND_S)
    except TimeoutError:
        raise AssertionError(f"{what} did not happen within {BOUND_S:g} s") from None


async def replay(ctx, port: int, fmt: str, start: int = 0) -> list[tuple[int, bytes]]:
    """Ask a replay endpoint for everything from `start`: [(seq, payload)], checking each engine's framing."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        for _ in range(100_000):
            frames = await bounded(dealer.recv_multipart(), "a replay answer")
            assert frames[0] == b""
            if fmt == "vllm":  # [b"", topic, seq, payload]; the end marker has an empty topic
                assert len(frames) == 4 and frames[1] in (b"kv", b"")
                frames = [b"", *frames[2:]]
            assert len(frames) == 3
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == -1:
                assert frames[2] == b""
                return out
            out.append((seq, frames[2]))
        raise AssertionError("the replay never ended")
    finally:
        dealer.close(linger=0)


def decode(payload: bytes, rank: int) -> list[dict]:
    ts, events, dp_rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and dp_rank == rank and isinstance(events, list) and events
    return events


async def history(ctx, base: int, fmt: str, rank: int, holds, what: str) -> list[dict]:
    """Every event rank `rank` published (from its replay buffer), once `holds(events)`."""
    seen: list[dict] = []

    async def showed() -> bool:
        batches = await replay(ctx, base + 2 + rank, fmt)
        assert [s for s, _ in batches] == list(range(len(batches)))  # a fresh stream, no gap
        seen[:] = [e for _, p in batches for e in decode(p, rank)]
        return holds(seen)
    try:
        await until(showed, what, timeout=BOUND_S, interval=0.01)
    except AssertionError as e:
        raise AssertionError(f"{e}; the last events: {summary(seen)}") from None
    return seen


def summary(events: list[dict]) -> list:
    return [(e["type"], e.get("medium"), len(e.get("block_hashes", []))) for e in events][-20:]


def stored_pages(events: list[dict], medium: str = "GPU") -> list[tuple[int, int | None, list[int]]]:
    """(hash, parent, token ids) of every page stored on `medium`, in order."""
    out = []
    for e in events:
        if e["type"] == "BlockStored" and e["medium"] == medium:
            parent = e["parent_block_hash"]
            for i, h in enumerate(e["block_hashes"]):
                out.append((h, parent, e["token_ids"][i * e["block_size"]:(i + 1) * e["block_size"]]))
                parent = h
    return out


def removed(events: list[dict], medium: str) -> list[int]:
    return [h for e in events if e["type"] == "BlockRemoved" and e["medium"] == medium for h in e["block_hashes"]]


def prompt_ids(body: dict) -> list[int]:
    tok = load_tokenizer()
    return list(tok.encode(tok.render(body)))


async def post(client, body: dict) -> dict:
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# --- the wire format against the engines' own bytes ----------------------------------------------

def fixture(*names: str) -> Path:
    """A file of the engines' captured frames (tests/fixtures, else shared/fixtures beside the repository)."""
    for root in (Path(__file__).parent / "fixtures" / "kv-events", Path(__file__).parents[2] / "shared" / "fixtures"):
        for name in names:
            if (root / name).exists():
                return root / name
    pytest.skip(f"no {names[0]} fixture here")


@pytest.mark.unit
def test_encodings_are_byte_identical_to_the_engines_frames():
    import base64

    frames = json.loads(fixture("vllm/live-batches.json", "vllm-kv-events/live-batches.json").read_text())
    vllm = wire("vllm", 32)
    for frame in frames:
        payload = base64.b64decode(frame["frames_b64"][2])
        ts, events, rank = msgpack.unpackb(payload)
        mine = [e for ev in events for e in vllm.stored(ev["parent_block_hash"], ev["block_hashes"], ev["token_ids"],
                                                       False)]
        assert vllm.batch(ts, mine, rank) == payload
    batches = json.loads(fixture("sglang/batches.json", "sglang-kv-events/batches.json").read_text())
    sglang = wire("sglang", 4)
    store, move, clear = (base64.b64decode(b["payload_b64"]) for b in batches)
    ts = [b["decoded"][0] for b in batches]
    assert sglang.batch(ts[0], sglang.stored(None, [111, 222], [0, 1, 2, 3, 4, 5, 6, 7], False), 3) != store  # SGLang emits one event per page (the fixture packs two: a struct sample)
    assert sglang.batch(ts[1], sglang.removed([222], False) + sglang.stored(111, [222], [4, 5, 6, 7], True), 3) == move
    assert sglang.batch(ts[2], sglang.cleared(), 3) == clear


# --- stores, repeats, evictions, host tier ------------------------------------------------------

@pytest.mark.e2e
@both
async def test_a_cold_prompt_streams_its_pages_live_with_token_ids_and_parent_chain(fmt, zctx):
    base = free_ports(4)
    sub = zctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{base + 1}")
    sub.subscribe(b"")
    async with publishing(fmt, base) as (c, _):
        for i in range(200):  # a SUB misses what is sent before its subscription lands: poke until it is live
            await post(c, chat(filler(PAGE + 4, 900 + i), max_tokens=1, routed_dp_rank=1))
            if await sub.poll(50):
                break
        else:
            raise AssertionError("the SUB socket never received a batch")
        body = chat(filler(100, 1), max_tokens=40, ignore_eos=True, routed_dp_rank=1)
        answer = await post(c, body)
        ids = prompt_ids(body)
        sequence = ids + list(load_tokenizer().encode(answer["choices"][0]["message"]["content"]))
        want = (len(sequence) - 1) // PAGE  # generated tokens' pages too; the last token has no KV yet
        live, pages = [], []
        while not pages or pages[-1][2] != sequence[(want - 1) * PAGE:want * PAGE]:
            topic, seq, payload = await bounded(sub.recv_multipart(), "the cold prompt's pages")
            assert topic == b"kv" and len(seq) == 8
            live.append((int.from_bytes(seq, "big"), payload))
            events = decode(payload, 1)
            for page in stored_pages(events):  # from the cold prompt's first page on (the pokes came before)
                if pages or page[2] == sequence[:PAGE]:
                    pages.append(page)
        assert [s for s, _ in live] == list(range(live[0][0], live[-1][0] + 1))  # consecutive numbers
        assert [p[2] for p in pages] == [sequence[i * PAGE:(i + 1) * PAGE] for i in range(want)]
        assert pages[0][1] is None and [p[1] for p in pages[1:]] == [p[0] for p in pages[:-1]]
        assert len({p[0] for p in pages}) == want and all(type(p[0]) is int for p in pages)
        stored = [e for _, p in live for e in decode(p, 1) if e["type"] == "BlockStored"]
        assert all(list(e) == STORED_KEYS[fmt] and e["block_size"] == PAGE and e["lora_id"] is None for e in stored)
        if fmt == "sglang":
            assert all(len(e["block_hashes"]) == 1 for e in stored)  # one event per page
        else:
            assert any(len(e["block_hashes"]) > 1 for e in stored)  # a run of blocks per event
            assert all(e["extra_keys"] == [None] * len(e["block_hashes"]) and e["group_idx"] == 0
                       and e["kv_cache_spec_kind"] == "full_attention" for e in stored)
        buffered = dict(await replay(zctx, base + 3, fmt))
        assert all(buffered[s] == p for s, p in live)  # the replay buffer holds the very same bytes
    sub.close(linger=0)


@pytest.mark.e2e
@both
async def test_a_repeat_stores_nothing_new_and_eviction_removes_pages(fmt, zctx):
    base = free_ports(4)
    async with publishing(fmt, base, kv_tokens_per_rank=16 * PAGE) as (c, _):
        first = chat(filler(100, 2), max_tokens=1)  # 6 full pages of 16
        ids = prompt_ids(first)
        await post(c, {**first, "routed_dp_rank": 0})
        events = await history(zctx, base, fmt, 0, lambda ev: len(stored_pages(ev)) >= 6, "the first prompt")
        mine = [h for h, _, _ in stored_pages(events)]
        assert [t for _, _, t in stored_pages(events)] == [ids[i * PAGE:(i + 1) * PAGE] for i in range(6)]
        again = await post(c, {**first, "routed_dp_rank": 0})
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        marker = chat(filler(40, 3), max_tokens=1)
        await post(c, {**marker, "routed_dp_rank": 0})
        marker_ids = prompt_ids(marker)
        events = await history(zctx, base, fmt, 0, lambda ev: any(t == marker_ids[:PAGE] for _, _, t in
                                                                   stored_pages(ev)), "the marker prompt")
        pages = stored_pages(events)
        assert len(pages) == 6 + len(marker_ids) // PAGE and [h for h, _, _ in pages[:6]] == mine  # repeat: none
        big = chat(filler(200, 4), max_tokens=1)  # 12 pages: the pool keeps 16, so the first prompt goes
        await post(c, {**big, "routed_dp_rank": 0})
        events = await history(zctx, base, fmt, 0, lambda ev: len(removed(ev, "GPU")) >= 4, "evictions")
        gone = removed(events, "GPU")
        removals = [e for e in events if e["type"] == "BlockRemoved"]
        assert all(list(e) == ["type", "block_hashes", "medium"] + (["group_idx"] if fmt == "vllm" else [])
                   and len(e["block_hashes"]) == 1 for e in removals)  # both engines report blocks one by one
        assert set(gone) <= {h for h, _, _ in stored_pages(events)} and not removed(events, HOST_MEDIUM[fmt])
        assert gone[0] == mine[-1]  # a radix tree evicts leaves: the least recent conversation's tail first


@pytest.mark.e2e
@both
async def test_host_tier_offload_and_reload_change_the_medium(fmt, zctx):
    base = free_ports(4)
    host = HOST_MEDIUM[fmt]
    async with publishing(fmt, base, kv_tokens_per_rank=16 * PAGE, hicache_tokens_per_rank=64 * PAGE) as (c, _):
        first = chat(filler(100, 5), max_tokens=1, routed_dp_rank=0)
        await post(c, first)
        await post(c, chat(filler(240, 6), max_tokens=1, routed_dp_rank=0))  # pushes all of the first to the host
        events = await history(zctx, base, fmt, 0, lambda ev: len(stored_pages(ev, host)) >= 6, "offloads")
        gpu = {h: (parent, t) for h, parent, t in stored_pages(events)}
        offloaded = stored_pages(events, host)
        assert all(gpu[h] == (parent, t) for h, parent, t in offloaded)  # same page, same name, other medium
        assert [h for h, _, _ in offloaded] == removed(events, "GPU")[:len(offloaded)]
        back = await post(c, {**first, "return_cached_tokens_details": True})
        assert back["sglext"]["cached_tokens_details"]["host"] >= 6 * PAGE
        before = len(events)
        events = await history(zctx, base, fmt, 0, lambda ev: len(removed(ev, host)) >= 6, "reloads")
        reloaded = removed(events[before:], host)
        again = {h for h, _, _ in stored_pages(events[before:])}
        assert set(reloaded) <= again and set(reloaded) <= {h for h, _, _ in offloaded}


@pytest.mark.e2e
@both
async def test_flush_cache_clears_every_rank(fmt, zctx):
    base = free_ports(4)
    async with publishing(fmt, base) as (c, _):
        body = chat(filler(60, 7), max_tokens=1, routed_dp_rank=0)
        await post(c, body)
        assert (await c.post("/flush_cache")).status_code == 200
        for rank in (0, 1):
            events = await history(zctx, base, fmt, rank, lambda ev: bool(ev) and ev[-1] == {
                "type": "AllBlocksCleared"}, f"rank {rank} clearing")
            assert events[-1] == {"type": "AllBlocksCleared"}
        assert (await post(c, body))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# --- replay, restart ---------------------------------------------------------------------------

@pytest.mark.e2e
@both
async def test_replay_is_bounded_by_buffer_steps_and_a_restart_starts_at_zero(fmt, zctx):
    base = free_ports(4)
    async with publishing(fmt, base, buffer_steps=3) as (c, engine):
        for i in range(6):
            await post(c, chat(filler(40, 10 + i), max_tokens=1, routed_dp_rank=0))
        # every request stored pages in a batch of its own
        await until(lambda: engine.publishers.events[0].publisher.sent >= 6, "the publisher sending six batches",
                    timeout=BOUND_S, interval=0.01)
        sent = engine.publishers.events[0].publisher.sent
        batches = await replay(zctx, base + 2, fmt)
        assert [s for s, _ in batches] == [sent - 3, sent - 2, sent - 1]  # only the last buffer_steps
        assert [s for s, _ in await replay(zctx, base + 2, fmt, start=sent - 1)] == [sent - 1]
        assert await replay(zctx, base + 2, fmt, start=sent + 5) == []  # just the end marker
    async with publishing(fmt, base, buffer_steps=3) as (c, _):  # a new engine on the same ports
        body = chat(filler(40, 30), max_tokens=1, routed_dp_rank=0)
        await post(c, body)
        events = await history(zctx, base, fmt, 0, lambda ev: bool(stored_pages(ev)), "the new stream")
        assert len(stored_pages(events)) == len(prompt_ids(body)) // PAGE  # history() checked it starts at 0


# --- discovery and the load publisher (SGLang) --------------------------------------------------

@pytest.mark.e2e
async def test_server_info_advertises_the_publishers_as_sglang_does():
    base = free_ports(6)
    async with publishing("sglang", base, load_publish_endpoint="auto") as (c, _):
        info = (await c.get("/server_info")).json()
        assert info["kv_events"] == {"publisher": "zmq", "endpoint_host": "127.0.0.1", "endpoint_port_base": base,
                                     "topic": "kv", "block_size": PAGE, "dp_size": 2,
                                     "load_endpoint_port_base": base + 4,  # past the replay range
                                     "load_topic": "load"}
        assert info["kv_events_config"] == events_config("sglang", base)
        assert (await c.get("/get_server_info")).json()["kv_events"] == info["kv_events"]
    async with publishing("vllm", base) as (c, _):
        assert (await c.get("/server_info")).json()["kv_events"] is None  # vLLM advertises nothing
    async with sim_client() as (c, _):
        info = (await c.get("/server_info")).json()
        assert info["kv_events"] is None and info["kv_events_config"] is None


@pytest.mark.e2e
async def test_load_publisher_pushes_loadstat_per_rank(zctx):
    base = free_ports(6)
    sub = zctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{base + 4}")
    sub.subscribe(b"load")
    async with publishing("sglang", base, load_publish_endpoint="auto", kv_tokens_per_rank=4096,
                          time_scale=50.0, decode_tokens_per_s=32.0) as (c, _):  # decoding for seconds
        busy = asyncio.create_task(c.post("/v1/chat/completions", json=chat(
            filler(50, 40), max_tokens=100_000, ignore_eos=True, routed_dp_rank=0)))
        try:
            stat, seqs = None, []
            while stat is None or stat[1] != 1:
                topic, seq, payload = await bounded(sub.recv_multipart(), "a LoadStat with one running request")
                assert topic == b"load"
                seqs.append(int.from_bytes(seq, "big"))
                stat = msgpack.unpackb(payload)
            assert stat[0] == "LoadStat" and len(stat) == 11 and stat[4] == 4096 and stat[5] == 0
            assert stat[2] == 0 and stat[3] > 50 and stat[8] == 16  # waiting, tokens in use, max running
            assert seqs == sorted(seqs)
            busy.cancel()  # the client goes away: the rank goes idle and says so
            while stat[1] != 0:
                stat = msgpack.unpackb((await bounded(sub.recv_multipart(), "an idle LoadStat"))[2])
            assert stat[3] == 0 and stat[4] == 4096
        finally:
            busy.cancel()
    sub.close(linger=0)


@pytest.mark.unit
def test_bad_event_settings_are_refused():
    from ramjet.sim.config import SimConfig

    for bad in ({"kv_events_config": "{not json"}, {"kv_events_format": "trt"},
                {"kv_events_config": '{"publisher": "kafka"}'},
                {"kv_events_config": '{"publisher": "zmq", "endpoint": "ipc:///tmp/x"}'},
                {"load_publish_endpoint": "auto"},  # without events
                {"kv_events_config": '{"enable_kv_cache_events": true}', "kv_events_format": "vllm",
                 "load_publish_endpoint": "auto"}):  # vLLM has no load publisher
        with pytest.raises(ValueError):
            SimConfig(**bad)
    assert SimConfig(kv_events_config='{"endpoint": "tcp://*:1"}').kv_events() is None  # SGLang's default: null
    assert SimConfig(kv_events_config='{"publisher": "zmq"}', kv_events_format="vllm").kv_events() is None


# --- a real process: flags, and a restart is a new stream -------------------------------------

@pytest.mark.e2e
def test_a_restarted_process_starts_a_new_stream_at_zero(tmp_path):
    base = free_ports(4)  # the event ports stay: a restart publishes on the same ones
    args = ["--dp-size", "2", "--page-tokens", str(PAGE), "--time-scale", "200", "--kv-events-format", "vllm",
            "--kv-events-config", events_config("vllm", base), "--tokenizer", SHIPPED_DIR]
    ctx = zmq.Context()
    try:
        for run in range(2):
            port = free_ports(1)  # a fresh HTTP port: the last one may be taken by then
            proc = start_sim(port, *args, log_path=tmp_path / f"sim{run}.log")
            try:
                body = chat(filler(40, 50 + run), max_tokens=1, routed_dp_rank=1)
                assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30).is_success
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.RCVTIMEO, int(BOUND_S * 1000))
                dealer.connect(f"tcp://127.0.0.1:{base + 3}")
                for _ in range(200):  # the batch is flushed at the rank's next step: ask until it is there
                    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                    frames = [dealer.recv_multipart()]
                    while frames[-1][2] != (-1).to_bytes(8, "big", signed=True):
                        frames.append(dealer.recv_multipart())
                    if len(frames) > 1:
                        break
                dealer.close(linger=0)
                assert [int.from_bytes(f[2], "big") for f in frames[:-1]] == [0]  # this process's stream only
                ids = prompt_ids(body)
                pages = len(ids) // PAGE
                assert msgpack.unpackb(frames[0][3])[1][0]["token_ids"] == ids[:pages * PAGE]  # one vLLM event
            finally:
                proc.kill()
    finally:
        ctx.destroy(linger=0)


# --- the tokenizer and chat template ------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file — any file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


def agent_turns() -> list[dict]:
    """An agent session: system, task, then tool calls and results, with reasoning inside the tool loop."""
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Fix the failing test.\n" + filler(80, 60)}]
    turns = [{"messages": list(messages), "tools": TOOLS}]
    for k in range(4):
        call = {"id": f"call_{k}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/m{k}.py"})}}
        messages += [{"role": "assistant", "content": "Reading it." if k % 2 else "", "tool_calls": [call],
                      "reasoning_content": f"step {k}: look at m{k}"},
                     {"role": "tool", "tool_call_id": f"call_{k}", "content": f"def f{k}():\n    return {k}\n"}]
        turns.append({"messages": list(messages), "tools": TOOLS, "max_tokens": 9, "stream": k % 2 == 0})
    return turns


@pytest.mark.unit
def test_each_turn_extends_the_last_token_for_token_and_reasoning_is_dropped_after_a_new_user_turn():
    tok = load_tokenizer()
    turns = [list(tok.encode(tok.render(t))) for t in agent_turns()]
    for before, after in itertools.pairwise(turns):
        assert after[:len(before)] == before and len(after) > len(before)
    last = agent_turns()[-1]
    text = tok.render(last)
    assert "<think>\nstep 3: look at m3\n</think>" in text and "<tool_call>" in text and "<tool_response>" in text
    followed = {**last, "messages": [*last["messages"], {"role": "user", "content": "Thanks."}]}
    rewritten = tok.render(followed)
    assert "step 3" not in rewritten  # the template drops old reasoning on purpose: no longer an extension
    assert not rewritten.startswith(text) and rewritten.startswith(text[:text.index("<think>")])


@pytest.mark.unit
def test_template_follows_hugging_face_rendering_rules():
    render = load_tokenizer().render
    text = render({"messages": [{"role": "user", "content": "héllo"}], "tools": TOOLS})
    assert text.startswith("<|startoftext|><|im_start|>system\n")  # bos_token comes from the tokenizer config
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text  # tojson is json.dumps: keys in order, no escaping
    assert text.endswith("<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n")
    plain = render({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False})
    assert plain.endswith("x<|im_end|>\n")
    quiet = render({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": False}})
    assert quiet.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.unit
async def test_generated_pages_serve_the_next_turn_and_bad_templates_inputs_are_400():
    async with sim_client(dp_size=1, page_tokens=PAGE) as (c, _):
        first = chat(filler(100, 70), max_tokens=60, ignore_eos=True)
        answer = await post(c, first)
        p, n = answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]
        second = {**first, "messages": [*first["messages"], answer["choices"][0]["message"],
                                         {"role": "user", "content": "more"}]}
        cached = (await post(c, second))["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (p + n - 1) // PAGE * PAGE > p  # the output's pages were cached and reused
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
        assert r.status_code == 400 and "unknown role" in r.json()["error"]["message"]


@pytest.mark.unit
def test_shipped_files_match_the_build_script_and_long_texts_tokenize_incrementally():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build", f"{SHIPPED_DIR}/build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    with open(f"{SHIPPED_DIR}/tokenizer_config.json", encoding="utf-8") as f:
        config = json.load(f)
    assert config["chat_template"] == build.CHAT_TEMPLATE and config["eos_token"] == build.EOS
    tok = load_tokenizer()
    assert tok.chunked and tok.vocab_size == build.VOCAB_SIZE + len(build.MARKERS)
    text = "".join(f"{i}: " + filler(30, i) + "\n" * (1 + i % 3) for i in range(2_000))  # ~60K tokens
    assert list(tok.encode(text)) == tok.hf.encode(text, add_special_tokens=False).ids
    more = text + "a new tool result\n" * 50
    assert tok.uncached_chars(text) == 0 and tok.uncached_chars(more) < 6_000  # only the tail is tokenized again


@pytest.mark.unit
async def test_tokenizer_flag_loads_another_directory(tmp_path):
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(f"{SHIPPED_DIR}/{name}", tmp_path / name)
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}" \
               "{% if add_generation_prompt %}[assistant] {% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>"}, "chat_template": [{"name": "default", "template": template}]}))
    hf = load_tokenizer().hf
    async with sim_client(tokenizer_dir=str(tmp_path)) as (c, engine):
        usage = (await post(c, chat("hello there", max_tokens=1)))["usage"]
        assert usage["prompt_tokens"] == len(hf.encode("[user] hello there\n[assistant] ",
                                                       add_special_tokens=False).ids)
        assert engine.tokenizer.eos_id == hf.token_to_id("<|endoftext|>")
        (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")  # the newer layout wins
    async with sim_client(tokenizer_dir=str(tmp_path) + "/") as (c, _):
        assert (await post(c, chat("hello there", max_tokens=1)))["usage"]["prompt_tokens"] == len(
            hf.encode("hello there", add_special_tokens=False).ids)


@pytest.mark.unit
def test_messages_reach_the_template_as_sglang_prepares_them():
    from ramjet.sim.template import ChatTemplate

    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}, {"type": "text", "text": "b"}]
    body = {"messages": [{"role": "user", "content": parts, "name": None}], "add_generation_prompt": False}
    assert load_tokenizer().render(body) == "<|startoftext|><|im_start|>user\na b<|im_end|>\n"  # "string" format
    looping = ChatTemplate("{% for m in messages %}{{ m | tojson }}{% for c in m.content %}<{{ c.type }}>{% endfor %}"
                           "{% endfor %}", {})
    assert looping.content_format == "openai"
    assert looping.render(body) == json.dumps({"role": "user", "content": [parts[0], {"type": "image"}, parts[2]]}) \
        + "<text><image><text>"  # parts kept, media reduced to their type, null fields gone

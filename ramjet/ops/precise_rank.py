"""One DP rank of `ramjet check-precise`: its KV event stream followed while a conversation runs on it.

The stream is subscribed first; a throwaway request or three proves a batch arrives (what
the stream said before that is its history, not the check's); then each turn is sent only
once the stream has gone quiet, and judged (ops/precise_probe.py) once the turn's blocks
were reported and the stream is quiet again, or the wait ran out.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from ramjet.kvevents.discovery import Endpoints
from ramjet.kvevents.subscriber import EventStream, StreamState
from ramjet.kvevents.wire import Batch
from ramjet.ops.engine_json import CheckError
from ramjet.ops.hicache_probe import filler
from ramjet.ops.precise_probe import RankReport, RankView, Turn, judge_turn

_COUNTED_STATES = ("partial", "disconnected", "restart")  # what makes precise mode distrust a stream


@dataclass(frozen=True)
class Options:
    ranks: tuple[int, ...] | None = None  # None: every rank the engine reports (rank 0 when it reports none)
    turns: int = 4
    turn_tokens: int = 1024               # new prompt text per turn, roughly 4 characters a token
    max_tokens: int = 16
    event_timeout_s: float = 10.0         # how long an answered turn's events may take to arrive
    quiet_s: float = 0.3                  # a stream this long without a batch has said what it will say
    events_endpoint: str | None = None    # as RJ_KV_EVENTS_ENDPOINT: a template or a list; None: /server_info
    replay_endpoint: str | None = None    # as RJ_KV_EVENTS_REPLAY_ENDPOINT
    topic: str | None = None              # as RJ_KV_EVENTS_TOPIC; None: the engine's own (or every topic)
    model: str | None = None
    seed: int | None = None


class Engine(Protocol):
    """What a rank's check needs of the run (check_precise.Checker)."""

    opts: Options
    rng: random.Random
    say: Callable[[str], None]
    after_turn: Callable[[int, int], Awaitable[None]] | None

    async def chat(self, messages: list[dict], rank: int, pin: bool) -> dict: ...


class RankCheck:
    """One rank: its event stream followed while the conversation runs."""

    def __init__(self, checker: Engine, rank: int, endpoints: Endpoints | None, pin: bool):
        self.c, self.rank, self.endpoints, self.pin = checker, rank, endpoints, pin
        self.view = RankView()
        self.batches, self.last_batch = 0, -1e18
        self.armed = False
        self.states: list[tuple[str, str]] = []

    async def run(self) -> RankReport:
        o, e = self.c.opts, self.endpoints
        report = RankReport(self.rank, e.events if e else "none", wanted=o.turns)
        if e is None:
            report.unreachable = ("the engine advertises no KV event publisher (/server_info kv_events is null): "
                                  "start it with --kv-events-config '{\"publisher\": \"zmq\", ...}'")
            return report
        report.unreachable = await unreachable(e)
        if report.unreachable:
            return report
        stream = EventStream(e, silence_s=max(o.event_timeout_s, 1.0))
        follower = asyncio.create_task(self._follow(stream))
        try:
            if await self._hello(report):
                self.armed = True
                await self._conversation(report)
        finally:
            stream.close()
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
        report.states = [s for s in self.states if s[0] in _COUNTED_STATES]
        return report

    async def _follow(self, stream: EventStream) -> None:
        async for item in stream.items():
            if isinstance(item, Batch):
                self.view.apply(item.events)
                self.batches += 1
                self.last_batch = time.monotonic()
            elif isinstance(item, StreamState) and self.armed:  # before: the stream's history, not the check's
                self.states.append((item.kind, item.detail))

    async def _hello(self, report: RankReport) -> bool:
        """A throwaway request or three, until a batch arrives: the publisher is reachable and speaks."""
        wait = max(self.c.opts.event_timeout_s / 3, 0.5)
        for attempt in range(1, 4):
            try:
                await self._throwaway()
            except CheckError as err:
                report.stopped = f"it refused the first request: {err}"
                return False
            if await _until(lambda: self.batches > 0, wait):
                return True
        report.unreachable = (f"no KV event arrived from {self.endpoints.events} within {3 * wait:.0f}s of "
                              f"{attempt} answered requests: the publisher is not reachable from here, or the "
                              "engine publishes no events")
        return False

    async def _throwaway(self) -> None:
        """A short request of its own (a prompt no other shares), so the rank publishes a batch."""
        text = f"{self.c.rng.getrandbits(64):016x} hello from ramjet check-precise.\n" + filler(64, self.c.rng)
        await self.c.chat([{"role": "user", "content": text}], self.rank, self.pin)

    async def _conversation(self, report: RankReport) -> None:
        o, rng = self.c.opts, self.c.rng
        nonce = f"{rng.getrandbits(64):016x}"
        messages = [{"role": "system", "content": f"{nonce} You are a coding agent in this repository.\n"
                     + filler(o.turn_tokens, rng)},
                    {"role": "user", "content": "Turn 1. Summarise these notes.\n" + filler(o.turn_tokens, rng)}]
        root = None
        for n in range(1, o.turns + 1):
            await _until(lambda: time.monotonic() - self.last_batch >= o.quiet_s, o.event_timeout_s)
            held, start = self.view.held(), len(self.view.stored)
            try:
                answer = await self.c.chat(messages, self.rank, self.pin)
            except CheckError as err:
                report.stopped = f"turn {n}: {err}"
                return
            turn, chain = await self._judged(start, held, root, n, answer["usage"])
            report.turns.append(turn)
            self.c.say(_turn_line(self.rank, turn))
            if chain is not None and root is None:
                root = chain[0]
            if self.c.after_turn is not None:
                await self.c.after_turn(self.rank, n)
            content = ((answer.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
            messages += [{"role": "assistant", "content": content},
                         {"role": "user", "content": f"Turn {n + 1}. And these.\n" + filler(o.turn_tokens, rng)}]

    async def _judged(self, start: int, held: frozenset[int], root: int | None, n: int, usage: dict):
        """The turn judged once its blocks were reported and the stream went quiet, or the wait ran out.

        A batch dropped on its way shows only when a later one arrives, which an idle rank never
        sends: when the wait runs out, one throwaway request makes the rank publish again, so the
        drop is seen (and filled from the replay, or known lost) before the turn is judged.
        """
        o = self.c.opts
        nudged, deadline = False, time.monotonic() + o.event_timeout_s
        while True:
            turn, chain = judge_turn(self.view, self.view.stored[start:], held, root, n, usage)
            if chain is not None and time.monotonic() - self.last_batch >= o.quiet_s:
                return turn, chain
            if time.monotonic() > deadline:
                if nudged or chain is not None:
                    return turn, chain
                nudged, deadline = True, time.monotonic() + o.event_timeout_s
                with contextlib.suppress(CheckError):
                    await self._throwaway()
            await asyncio.sleep(0.02)


def _turn_line(rank: int, t: Turn) -> str:
    cached = "not reported" if t.cached_tokens is None else f"{t.cached_tokens:,}"
    if t.predicted is None:
        return f"rank {rank} turn {t.number}: {t.prompt_tokens:,} prompt tokens, {cached} cached; {t.note}"
    agreed = {True: "agreed", False: "DISAGREED", None: "not compared"}[t.agreed]
    return (f"rank {rank} turn {t.number}: {t.prompt_tokens:,} prompt tokens, {cached} cached, the events "
            f"predicted {t.predicted:,} ({agreed}, block {t.block})")


async def _until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def unreachable(e: Endpoints, timeout_s: float = 3.0) -> str:
    """Why the rank's event publisher cannot be reached over TCP ("" when it can, or when it connects to us)."""
    if e.bind:
        return ""
    host, _, port = e.events.removeprefix("tcp://").rpartition(":")
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    except (OSError, TimeoutError, ValueError) as err:
        return (f"its event publisher {e.events} cannot be reached ({err or f'no answer in {timeout_s:g}s'}): a "
                "firewall, a wrong port (rank r publishes on the base port + r), or events are off")
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return ""

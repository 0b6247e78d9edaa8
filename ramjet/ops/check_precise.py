"""`ramjet check-precise URL`: on this engine, would precise mode (RJ_KV_EVENTS=zmq) route on a true picture?

Precise mode routes on what each DP rank's KV event stream says its cache holds, and
falls back, rank by rank, to the approximate index when it cannot trust a stream
(docs/design.md). Before turning it on, this command asks the engine itself: it finds
each rank's event publisher (SGLang advertises them in `/server_info` `kv_events`; vLLM
advertises nothing, so they are given, as for the balancer: `--kv-events-endpoint`,
default $RJ_KV_EVENTS_ENDPOINT), confirms it can reach them and that a batch arrives,
then holds a short conversation with each rank (a growing chat prompt, a few turns,
pinned to the rank) and compares, turn by turn, the cached tokens the events predict
(ops/precise_probe.py) with the engine's own `usage.prompt_tokens_details.cached_tokens`.

The last line is the verdict: "precise mode is safe here", "falls back on rank N
because ...", or "inconclusive: ...". Run it while the engine is quiet if you can: other
traffic on a rank does not make it wrong, but can make a turn's blocks hard to tell apart.
Exit codes: 0 safe; 1 falls back on some rank; 2 bad input or an engine error; 3 inconclusive.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace

import httpx

from ramjet.kvevents.discovery import Endpoints, from_operator, from_server_info, resolve
from ramjet.ops.engine_json import CheckError, engine_json
from ramjet.ops.precise_probe import FALLS_BACK, INCONCLUSIVE, MIN_TURNS, SAFE, overall
from ramjet.ops.precise_rank import Options, RankCheck

EXIT = {SAFE: 0, FALLS_BACK: 1, INCONCLUSIVE: 3}
EXIT_ERROR = 2


class Checker:
    """One run against one engine; `say` prints as it goes; `after_turn(rank, turn)` runs after each turn."""

    def __init__(self, client: httpx.AsyncClient, url: str, opts: Options, say: Callable[[str], None] = print,
                 after_turn: Callable[[int, int], Awaitable[None]] | None = None):
        self.client, self.url, self.opts, self.say, self.after_turn = client, url.rstrip("/"), opts, say, after_turn
        self.rng = random.Random(opts.seed)
        self.model = opts.model or "default"

    async def run(self) -> int:
        info = await self._server_info()
        if not self.opts.model:
            models = (await self._json("GET", "/v1/models")).get("data") or [{}]
            self.model = (models[0] or {}).get("id") or self.model
        ranks, pin = self._ranks(info)
        kind = "SGLang " + str(info.get("version", "?")) if info is not None else "no /server_info (vLLM?)"
        self.say(f"engine: {kind}, model {self.model}, checking rank{'s' if len(ranks) > 1 else ''} "
                 f"{', '.join(map(str, ranks))}")
        endpoints = {r: self._endpoints(info, r) for r in ranks}
        for r, e in endpoints.items():
            where = "none advertised" if e is None else (f"{'binding ' if e.bind else ''}{e.events}, replay "
                                                         f"{e.replay or 'none'}")
            self.say(f"rank {r}: event publisher {where}")
        reports = await asyncio.gather(*(RankCheck(self, r, endpoints[r], pin).run() for r in ranks))
        for report in reports:
            kind_, why = report.verdict()
            self.say(f"rank {report.rank}: {kind_}: {why}")
        verdict, line = overall(list(reports))
        self.say(line)
        return EXIT[verdict]

    async def _json(self, method: str, path: str, body: dict | None = None, headers: dict | None = None,
                    missing_ok: bool = False) -> dict | None:
        return await engine_json(self.client, method, self.url + path, body, headers, missing_ok)

    async def _server_info(self) -> dict | None:
        """SGLang's server arguments (its publishers among them); None for an engine without the route (vLLM)."""
        return (await self._json("GET", "/server_info", missing_ok=True)
                or await self._json("GET", "/get_server_info", missing_ok=True))

    def _ranks(self, info: dict | None) -> tuple[tuple[int, ...], bool]:
        dp = info.get("dp_size") if info else None
        dp = dp if type(dp) is int and dp >= 1 else None
        ranks = self.opts.ranks or tuple(range(dp or 1))
        outside = [r for r in ranks if dp is not None and r >= dp]
        if outside:
            raise CheckError(f"--ranks {','.join(map(str, outside))}: the engine has ranks 0..{dp - 1}")
        return ranks, self.opts.ranks is not None or (dp or 1) > 1

    def _endpoints(self, info: dict | None, rank: int) -> Endpoints | None:
        """Rank `rank`'s publishers; None when the engine says it publishes none."""
        o = self.opts
        try:
            if o.events_endpoint:
                return from_operator(o.events_endpoint, self.url, rank, rank, replay=o.replay_endpoint,
                                     topic=o.topic or "")
            if info is None:
                raise CheckError("the engine has no /server_info, so it advertises no KV event publishers (vLLM "
                                 "does not): pass --kv-events-endpoint tcp://{host}:PORT (rank r publishes on "
                                 "PORT + r; '@tcp://...' binds it for publishers that connect), as "
                                 "RJ_KV_EVENTS_ENDPOINT")
            found = from_server_info(info, self.url, rank)
            if found is None:
                return None
            if o.replay_endpoint:
                found = replace(found, replay=resolve(o.replay_endpoint, self.url, rank, rank, "replay endpoint"))
            return replace(found, topic=o.topic.encode()) if o.topic is not None else found
        except ValueError as e:
            raise CheckError(f"rank {rank}'s event endpoints: {e}") from None

    async def chat(self, messages: list[dict], rank: int, pin: bool) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": self.opts.max_tokens, "stream": False}
        headers = {}
        if pin:  # as the balancer pins: SGLang reads the body field, vLLM the header
            body["routed_dp_rank"] = rank
            headers["X-Data-Parallel-Rank"] = str(rank)
        answer = await self._json("POST", "/v1/chat/completions", body, headers)
        if not isinstance((answer.get("usage") or {}).get("prompt_tokens"), int):
            raise CheckError("a chat completion came back without usage.prompt_tokens")
        return answer


# --- CLI ---------------------------------------------------------------------------

def _ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(r) for r in text.split(","))
    except ValueError:
        ranks = ()
    if not ranks or any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
        raise argparse.ArgumentTypeError(f"expected distinct ranks >= 0 such as 0,1,2, got {text!r}")
    return ranks


def _positive(kind, least=1):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} >= {least}, got {text!r}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("url", help="the engine itself (e.g. http://127.0.0.1:30000), not the balancer: the check "
                                    "pins its requests to each DP rank")
    parser.add_argument("--ranks", type=_ranks, default=None,
                        help="DP ranks to check, e.g. 0,1 (default: every rank /server_info reports, else rank 0)")
    parser.add_argument("--kv-events-endpoint", default=env("RJ_KV_EVENTS_ENDPOINT") or None,
                        help="rank 0's event publisher as a template (tcp://{host}:5557: rank r on port + r; "
                             "@tcp://... binds, for vLLM publishers that connect) or a list, one per rank "
                             "(default $RJ_KV_EVENTS_ENDPOINT; unset: SGLang's /server_info)")
    parser.add_argument("--kv-events-replay-endpoint", default=env("RJ_KV_EVENTS_REPLAY_ENDPOINT") or None,
                        help="the replay endpoints, in the same forms (default $RJ_KV_EVENTS_REPLAY_ENDPOINT)")
    parser.add_argument("--kv-events-topic", default=env("RJ_KV_EVENTS_TOPIC"),
                        help="topic prefix to subscribe to (default $RJ_KV_EVENTS_TOPIC, else the engine's own)")
    parser.add_argument("--api-key", default=env("RAMJET_CHECK_API_KEY"),
                        help="bearer key for an engine started with --api-key (default $RAMJET_CHECK_API_KEY)")
    parser.add_argument("--model", default=None, help="model name to send (default: the engine's first model)")
    parser.add_argument("--turns", type=_positive(int, MIN_TURNS), default=4,
                        help=f"turns of the conversation per rank (default 4, at least {MIN_TURNS})")
    parser.add_argument("--turn-tokens", type=_positive(int), default=1024,
                        help="new prompt text per turn, roughly 4 characters a token (default 1024)")
    parser.add_argument("--max-tokens", type=_positive(int), default=16, help="output limit of each turn (default 16)")
    parser.add_argument("--event-timeout", type=_positive(float, 0.1), default=10.0,
                        help="seconds an answered turn's KV events may take to arrive (default 10)")
    parser.add_argument("--timeout", type=_positive(float, 0.1), default=300.0,
                        help="seconds to wait for one answer (default 300)")
    parser.add_argument("--seed", type=int, default=None, help="seed for the conversation's text (default random)")


def options(args: argparse.Namespace) -> Options:
    return Options(ranks=args.ranks, turns=args.turns, turn_tokens=args.turn_tokens, max_tokens=args.max_tokens,
                   event_timeout_s=args.event_timeout, events_endpoint=args.kv_events_endpoint,
                   replay_endpoint=args.kv_events_replay_endpoint, topic=args.kv_events_topic, model=args.model,
                   seed=args.seed)


async def _main(args: argparse.Namespace) -> int:
    if not args.url.startswith(("http://", "https://")):
        raise CheckError(f"URL must start with http:// or https://, got {args.url!r}")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(args.timeout, connect=10.0)) as client:
        return await Checker(client, args.url, options(args)).run()


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(args))
    except CheckError as e:
        print(f"ramjet check-precise: {e}", file=sys.stderr)
        return EXIT_ERROR

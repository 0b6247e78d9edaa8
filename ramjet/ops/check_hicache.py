"""`ramjet check-hicache URL`: does a prompt evicted to host memory come back, and is it still right?

Before measuring any host-tier (SGLang HiCache) configuration, the article flooded one
DP rank until an 86,000-token prompt was pushed out to host memory, sent the prompt
again, and checked that the model still recalled a fact from it and produced a
correctly typed tool call. This command runs that check against your engine.

It passes only on the engine's own evidence that the second answer was loaded from the
host tier: SGLang's per-request cache report (`sglext.cached_tokens_details.host`, asked
for with `return_cached_tokens_details`), or failing that its per-tier counter
`sglang:cached_tokens_total{cache_source="host"}`. A recomputed prompt says nothing
about the host tier, so without that evidence the result is INCONCLUSIVE, never a pass.

Exit codes: 0 pass; 1 the host-tier answer failed recall or the tool call; 2 bad input,
refused confirmation, or an engine error; 3 inconclusive.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from ramjet.ops.engine_json import CheckError, engine_json
from ramjet.ops.hicache_probe import (TOOLS, Fact, flood_messages, host_cached_tokens, judge, make_fact,
                                      pinned_messages, tier_report)

EXIT_PASS, EXIT_FAIL, EXIT_ERROR, EXIT_INCONCLUSIVE = 0, 1, 2, 3


@dataclass(frozen=True)
class Options:
    rank: int = 0
    prompt_tokens: int = 86_000  # the article's prompt size
    flood_tokens: int | None = None  # None: the rank's KV pool plus a tenth
    flood_prompt_tokens: int = 32_000
    min_host_fraction: float = 0.5  # of the prompt's tokens that must come from host memory
    rounds: int = 3
    max_tokens: int = 2048
    quality: bool = True
    seed: int | None = None
    model: str | None = None


@dataclass(frozen=True)
class EngineInfo:
    version: str
    dp_size: int
    capacity: int | None  # KV tokens per rank
    hicache: bool | None  # None: the engine does not say
    simulated: bool


class Checker:
    """One run of the check against one engine; `say` prints progress as it happens."""

    def __init__(self, client: httpx.AsyncClient, opts: Options, say: Callable[[str], None] = print):
        self.client = client
        self.opts = opts
        self.say = say
        self.rng = random.Random(opts.seed)
        self.nonce = f"{self.rng.getrandbits(64):016x}"
        self.model = opts.model or "default"

    async def _json(self, method: str, path: str, body: dict | None = None, fallback: str | None = None) -> dict:
        """`path`'s JSON object; with `fallback`, SGLang's older spelling of the route when `path` is missing."""
        data = await engine_json(self.client, method, path, body, missing_ok=fallback is not None)
        if data is None:
            data = await engine_json(self.client, method, fallback, body)
        return data

    async def engine_info(self) -> EngineInfo:
        info = await self._json("GET", "/server_info", fallback="/get_server_info")
        if not self.opts.model:
            models = (await self._json("GET", "/v1/models")).get("data") or [{}]
            self.model = models[0].get("id") or self.model
        try:
            dp = int(info.get("dp_size") or 1)
            capacity = int(info["max_total_num_tokens"]) if info.get("max_total_num_tokens") else None
        except (TypeError, ValueError):
            raise CheckError("/server_info has a non-numeric dp_size or max_total_num_tokens") from None
        hicache = info.get("enable_hierarchical_cache")
        return EngineInfo(str(info.get("version", "?")), dp, capacity, hicache if isinstance(hicache, bool) else None,
                          isinstance(info.get("simulator"), dict))

    async def host_metric(self) -> float | None:
        """The rank's host-tier cached-token counter, or None when /metrics has no per-tier split."""
        try:
            r = await self.client.get("/metrics")
        except httpx.HTTPError:
            return None
        return host_cached_tokens(r.text, self.opts.rank) if r.status_code == 200 else None

    async def chat(self, messages: list[dict], max_tokens: int, tools: bool = False) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "stream": False,
                "routed_dp_rank": self.opts.rank, "return_cached_tokens_details": True}
        if tools:
            body.update(tools=TOOLS, tool_choice="auto")
        answer = await self._json("POST", "/v1/chat/completions", body)
        if not isinstance((answer.get("usage") or {}).get("prompt_tokens"), int):
            raise CheckError("a chat completion came back without usage.prompt_tokens")
        return answer

    async def flood(self, target: int, capacity: int) -> tuple[int, int]:
        """Uncached prompt tokens pushed through the rank until `target`; returns (requests, tokens)."""
        size = max(1, min(self.opts.flood_prompt_tokens, capacity // 2))
        limit = 4 * (target // size + 1) + 8  # an engine that keeps caching the flood would loop forever
        sent = n = 0
        while sent < target:
            if n >= limit:
                raise CheckError(f"{n} flood prompts added only {sent:,} uncached tokens (wanted {target:,})")
            answer = await self.chat(flood_messages(size, f"{self.nonce}-{n}", self.rng), 1)
            usage = answer["usage"]
            sent += usage["prompt_tokens"] - _cached(answer)
            n += 1
        return n, sent

    async def run(self, confirm: Callable[[str], bool]) -> int:
        opts, say = self.opts, self.say
        info = await self.engine_info()
        tier = {True: "on", False: "off", None: "not reported"}[info.hicache]
        say(f"engine: SGLang {info.version}, {info.dp_size} DP ranks, "
            f"{f'{info.capacity:,}' if info.capacity else 'unknown'} KV tokens per rank, hierarchical cache {tier}"
            + (" (the simulator)" if info.simulated else ""))
        if not 0 <= opts.rank < info.dp_size:
            raise CheckError(f"--rank {opts.rank} is outside the engine's ranks 0..{info.dp_size - 1}")
        if info.hicache is False:
            say("INCONCLUSIVE: the engine reports enable_hierarchical_cache=false: there is no host tier to "
                "check (nothing was flooded)")
            return EXIT_INCONCLUSIVE
        if info.capacity is None and opts.flood_tokens is None:
            raise CheckError("the engine does not report max_total_num_tokens; pass --flood-tokens N "
                             "(more than one rank's KV pool)")
        capacity = info.capacity or opts.flood_tokens
        if opts.prompt_tokens >= capacity:
            raise CheckError(f"--prompt-tokens {opts.prompt_tokens:,} does not fit one rank's "
                             f"{capacity:,}-token KV pool")
        target = opts.flood_tokens or capacity + capacity // 10
        if not confirm(f"this floods DP rank {opts.rank} with about {target:,} tokens of throwaway prompts per "
                       f"round (up to {opts.rounds} rounds): every conversation cached on that rank is pushed out "
                       "of GPU memory, so other users' next turns there are recomputed or reloaded"):
            say("not run: flooding was not confirmed (pass --yes to run without asking)")
            return EXIT_ERROR

        fact = make_fact(self.rng)
        messages = pinned_messages(fact, opts.prompt_tokens, self.nonce, self.rng)
        cold = await self.chat(messages, opts.max_tokens, tools=True)
        prompt = cold["usage"]["prompt_tokens"]
        say(f"pinned: a {prompt:,}-token prompt on rank {opts.rank} ({_cached(cold):,} cached) stating "
            f"{fact.codename} / {fact.build_number}")
        need = opts.min_host_fraction * prompt
        for round_ in range(1, opts.rounds + 1):
            n, sent = await self.flood(target, capacity)
            say(f"flood {round_}: {n} prompts, {sent:,} uncached tokens on rank {opts.rank}")
            before = await self.host_metric()
            warm = await self.chat(messages, opts.max_tokens, tools=True)
            after = await self.host_metric()
            verdict, note = _classify(warm, need, None if before is None or after is None else after - before)
            say(f"resend: {note}")
            if verdict == "host":
                return self._quality(info, fact, cold, warm)
            if verdict != "device":
                say(f"INCONCLUSIVE: {verdict}")
                return EXIT_INCONCLUSIVE
        say(f"INCONCLUSIVE: after {opts.rounds} flood rounds the prompt was still served from GPU memory; "
            "pass a larger --flood-tokens")
        return EXIT_INCONCLUSIVE

    def _quality(self, info: EngineInfo, fact: Fact, cold: dict, warm: dict) -> int:
        say = self.say
        if not self.opts.quality or info.simulated:
            why = "--skip-quality" if not self.opts.quality else "simulated model (its text is filler)"
            say(f"recall: not checked: {why}")
            say(f"tool call: not checked: {why}")
            say("PASS: the prompt came back from the host tier (model quality not checked; it needs a real model)")
            return EXIT_PASS
        host, first = judge(warm, fact), judge(cold, fact)
        say(f"recall: {'OK' if host.recall[0] else 'FAIL'}: {host.recall[1]}")
        say(f"tool call: {'OK' if host.tool_call[0] else 'FAIL'}: {host.tool_call[1]}")
        if host.ok:
            say("PASS: the prompt came back from the host tier and the model still recalled the fact and "
                "produced a correctly typed tool call")
            return EXIT_PASS
        if first.ok:
            say("FAIL: the cold answer was right but the answer from the host tier was not: the reloaded cache "
                "is suspect")
        else:
            say("FAIL: the cold answer failed too, so the model or its parsers (not the host tier) missed the "
                "task; check --tool-call-parser and --reasoning-parser")
        return EXIT_FAIL


def _cached(answer: dict) -> int:
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _classify(answer: dict, need: float, host_delta: float | None) -> tuple[str, str]:
    """("host" | "device" | reason it is inconclusive, what the engine said about the resent prompt)."""
    prompt, cached, report = answer["usage"]["prompt_tokens"], _cached(answer), tier_report(answer)
    metric = "" if host_delta is None else f"; host-tier cached-token counter +{host_delta:,.0f}"
    if report is not None:
        host, device = int(report.get("host") or 0), int(report.get("device") or 0)
        note = (f"{prompt:,} prompt tokens, {cached:,} cached: {device:,} on the device, {host:,} loaded from host "
                f"memory (the engine's cache report){metric}")
        if host >= need:
            return "host", note
        if device >= need:
            return "device", note + "; still in GPU memory, flooding again"
        return (f"only {host:,} of {prompt:,} tokens came from host memory: the prompt was mostly recomputed (is "
                "the host tier smaller than the flood?)"), note
    note = f"{prompt:,} prompt tokens, {cached:,} cached; no per-tier cache report{metric}"
    if host_delta is not None and host_delta >= need:
        return "host", note + " (evidence from the engine's counter, which other traffic on the rank could also move)"
    if cached < need:
        return "the prompt was recomputed, not loaded from host memory: the host tier is off, too small, or "\
               "evicted it as well", note
    return ("the engine reports neither sglext.cached_tokens_details nor a per-tier counter, so a host-tier hit "
            "cannot be told from a GPU hit"), note


# --- CLI ---------------------------------------------------------------------------

def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the SGLang engine itself (e.g. http://127.0.0.1:30000), not the balancer: "
                                    "the check pins its requests to one DP rank")
    parser.add_argument("--rank", type=int, default=0, help="DP rank to flood and check (default 0)")
    parser.add_argument("--api-key", default=os.environ.get("RAMJET_CHECK_API_KEY"),
                        help="bearer key for an engine started with --api-key (default $RAMJET_CHECK_API_KEY)")
    parser.add_argument("--model", default=None, help="model name to send (default: the engine's first model)")
    parser.add_argument("--prompt-tokens", type=_positive(int), default=86_000,
                        help="size of the pinned prompt, roughly 4 characters a token (default 86000, as measured)")
    parser.add_argument("--flood-tokens", type=_positive(int), default=None,
                        help="uncached tokens to push through the rank per round (default: its KV pool + 10%%)")
    parser.add_argument("--flood-prompt-tokens", type=_positive(int), default=32_000,
                        help="size of each flood prompt (default 32000, at most half the pool)")
    parser.add_argument("--min-host-fraction", type=_positive(float), default=0.5,
                        help="share of the prompt that must come from host memory (default 0.5)")
    parser.add_argument("--rounds", type=_positive(int), default=3, help="flood rounds before giving up (default 3)")
    parser.add_argument("--max-tokens", type=_positive(int), default=2048,
                        help="output budget of the checked answers, reasoning included (default 2048)")
    parser.add_argument("--skip-quality", action="store_true",
                        help="check only that the prompt comes back from host memory, not the answer")
    parser.add_argument("--seed", type=int, default=None, help="seed for the fact and the filler (default random)")
    parser.add_argument("--timeout", type=_positive(float), default=900.0,
                        help="seconds to wait for one answer (default 900)")
    parser.add_argument("--yes", action="store_true", help="flood without asking (needed without a terminal)")


def _confirmer(yes: bool) -> Callable[[str], bool]:
    def confirm(warning: str) -> bool:
        print(f"WARNING: {warning}.", file=sys.stderr)
        if yes:
            return True
        if not sys.stdin.isatty():
            return False
        return input("Continue? [y/N] ").strip().lower() in ("y", "yes")
    return confirm


def options(args: argparse.Namespace) -> Options:
    if args.min_host_fraction > 1:
        raise CheckError("--min-host-fraction must be at most 1")
    if args.rank < 0:
        raise CheckError("--rank must be >= 0")
    return Options(rank=args.rank, prompt_tokens=args.prompt_tokens, flood_tokens=args.flood_tokens,
                   flood_prompt_tokens=args.flood_prompt_tokens, min_host_fraction=args.min_host_fraction,
                   rounds=args.rounds, max_tokens=args.max_tokens, quality=not args.skip_quality, seed=args.seed,
                   model=args.model)


async def _main(args: argparse.Namespace) -> int:
    if not args.url.startswith(("http://", "https://")):
        raise CheckError(f"URL must start with http:// or https://, got {args.url!r}")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    async with httpx.AsyncClient(base_url=args.url.rstrip("/"), headers=headers, timeout=timeout) as client:
        return await Checker(client, options(args)).run(_confirmer(args.yes))


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(args))
    except CheckError as e:
        print(f"ramjet check-hicache: {e}", file=sys.stderr)
        return EXIT_ERROR

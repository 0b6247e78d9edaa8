"""Precise mode's routing cost per request: render + tokenize + chain hashing + token index walk.

What the balancer adds to a request in precise mode (RJ_KV_EVENTS=zmq) before it
scores the replicas, measured on the simulator's tokenizer and chat template (the
tokenizer directory the balancer is given as RJ_TOKENIZER):

- warm extend: a coding agent's next turn, a 115K-token chat body that extends a
  conversation the balancer tokenized one turn earlier (its pieces are in the
  incremental tokenizer's cache; each repetition adds a new assistant message and a
  new tool result, about 1.6K tokens, so every repetition tokenizes new text);
- cold: a 115K-token prompt whose text the balancer has never seen.

Each request is rendered with the chat template and tokenized
(ramjet.routing.prompt_tokens.PromptTokenizer, loaded by
ramjet.balancer.precise.mode.load_tokenizer), hashed into 64-token blocks
(ramjet.routing.token_index.chain) and walked through a TokenIndex of 8 replicas
that holds this conversation's previous turn on one replica, part of it on another,
the shared harness on a third, and other sessions' blocks on every replica (a full
193K-token pool each). Parsing the JSON body is not counted (the balancer parses it
once for both modes; benchmarks/routing_cost.py measures it). The balancer runs this
on a worker thread; the figures are the work itself. It prints figures, it checks
nothing: the design target is a median of at most 2 ms for the warm extend. `--replicas` runs
it for other replica counts (issue 25): each replica's pool is 193K tokens up to 40 replicas
and 193K x 40 / replicas beyond, so the index holds the same 7.7M tokens at 2,048 as at 40.
`--trace FILE` instead tokenizes and hashes the first `--trace-requests` completions prompts of a
trace as `ramjet bench trace` writes them (one document each, no special token inside), with long
text cut at line seams (ramjet.routing.text_seams) and, for comparison, encoded whole; and, as the
balancer does, by the head (precise/matcher.py): routing waits for the prompt's head, and for its
rest only when a replica holds the head to its end, here one engine that computed every earlier
prompt and evicted nothing (one balancer in front of it; an engine that evicts holds less). Run:

    python benchmarks/precise_routing_cost.py [--repeat 300] [--cold-repeat 10] [--quick] [--replicas 8,40,2048]
    python benchmarks/precise_routing_cost.py --trace ../shared/traces/mooncake_synthetic.jsonl
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import time
from importlib.resources import files

from ramjet.balancer.precise.matcher import Matcher, load_tokenizer
from ramjet.bench.text import TextSource
from ramjet.bench.trace_load import BLOCK_TOKENS, load_trace
from ramjet.bench.trace_prompt import PromptMaker
from ramjet.bench.world import World, WorkloadConfig
from ramjet.routing.token_index import TokenIndex

BLOCK = 64                      # the simulator's page (SGLang's block size in its events)
REPLICAS = 8
POOL_TOKENS = 193_000           # per replica, as in `ramjet bench compare`
TOKENIZER_DIR = files("ramjet.sim") / "tokenizer"


def conversation(salt: str, tokens: int, tokenizer, step_tokens: int = 1500) -> list[dict]:
    """An agent conversation (harness system prompt and tools, repository instructions, then tool calls and
    results) whose rendered prompt is just under `tokens` tokens; the tools are returned as the last item."""
    text = TextSource(salt)
    world = World(WorkloadConfig(), seed=1, text=text)
    harness, repo = world.harnesses[1], world.repos[0]
    messages = [{"role": "system", "content": harness.system},
                {"role": "user", "content": repo.instructions + "\n\n" + text.text("task", 250)}]
    k = 0
    while True:
        step = [assistant(text, f"a{k}"), tool_result(text, f"t{k}", step_tokens)]
        if count(tokenizer, messages + step, harness.tools) > tokens:
            break
        messages += step
        k += 1
    for size in range(step_tokens, 0, -100):  # the last tool result fills what is left, to within 100 tokens
        step = [assistant(text, f"a{k}"), tool_result(text, f"t{k}", size)]
        if count(tokenizer, messages + step, harness.tools) <= tokens:
            return messages + step + [harness.tools]
    return messages + [harness.tools]


def assistant(text: TextSource, ident: str) -> dict:
    return {"role": "assistant", "content": text.text(ident, 120),
            "tool_calls": [{"id": ident, "type": "function",
                            "function": {"name": "read_file", "arguments": '{"target": "src/%s.py"}' % ident}}]}


def tool_result(text: TextSource, ident: str, tokens: int) -> dict:
    return {"role": "tool", "tool_call_id": ident, "content": text.text(ident, tokens)}


def count(tokenizer, messages: list[dict], tools: list) -> int:
    return len(tokenizer.encode(tokenizer.render_chat({"messages": messages, "tools": tools})))


def body(messages: list[dict], tools: list) -> dict:
    return {"model": "glm-5.3", "messages": messages, "tools": tools, "stream": True, "max_tokens": 1024}


def pool_tokens(replicas: int) -> int:
    return POOL_TOKENS if replicas <= 40 else POOL_TOKENS * 40 // replicas


def filled_index(own: list[int], rng: random.Random, replicas: int = REPLICAS) -> TokenIndex:
    """`replicas` replicas (at least 8), each a full pool of other sessions' blocks; this conversation's
    previous turn on replica 2, its first 60% on replica 5, its first 18K tokens (the harness) on replica 7."""
    index = TokenIndex(replicas)
    engine_hash = iter(range(1, 1 << 62))

    def store(replica: int, ids: list[int]) -> None:
        n = len(ids) // BLOCK
        index.stored(replica, [next(engine_hash) for _ in range(n)], None, ids[:n * BLOCK], BLOCK, "GPU")

    pool = pool_tokens(replicas)
    chains = [600 * BLOCK] * (pool // (600 * BLOCK)) or [pool]  # other sessions: chains of 600 blocks (38K tokens)
    for r in range(replicas):
        for tokens in chains:
            store(r, [rng.randrange(1, 30_000) for _ in range(tokens)])
    store(2, own)
    store(5, own[: len(own) * 6 // 10])
    store(7, own[:18_000])
    return index


def one(tokenizer, index: TokenIndex, request: dict) -> tuple[float, float, float, float, int, list]:
    """(render, tokenize, chain, walk) seconds for one request, its prompt tokens and what each replica holds."""
    t0 = time.perf_counter()
    text = tokenizer.render_chat(request)
    t1 = time.perf_counter()
    prompt = tokenizer.encode_rendered(text)
    t2 = time.perf_counter()
    hashes = Matcher.chain(prompt, BLOCK)
    t3 = time.perf_counter()
    held = index.held_chains({BLOCK: hashes})
    t4 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3, prompt.length, held


def one_head(matcher: Matcher, request: dict) -> tuple[float, float, float, float, int, list, float]:
    """As `one`, routed on the head as the balancer routes (precise/matcher.py): what routing waits for, and last
    the seconds of the rest tokenized after routing (0: some replica held the head to its end, so it was not)."""
    tokenizer = matcher.tokenizer
    t0 = time.perf_counter()
    text = tokenizer.render_chat(request)
    t1 = time.perf_counter()
    head = tokenizer.rendered_head(text)
    t2 = time.perf_counter()
    chains = {BLOCK: Matcher.chain(head.prompt, BLOCK)}
    t3 = time.perf_counter()
    held = matcher.index.held_chains(chains)
    t4 = time.perf_counter()
    now = head.rest is None or matcher.may_hold_more(held, chains)
    tokens, whole = matcher.finish(head, chains, [BLOCK])
    t5 = time.perf_counter()
    if now:
        return t1 - t0, t2 - t1 + t5 - t4, t3 - t2, t4 - t3, tokens, matcher.index.held_chains(whole), 0.0
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3, tokens, held, t5 - t4


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs)) - 1))]


def report(name: str, runs: list[tuple], new_tokens: int | None) -> None:
    render, encode, hashing, walk = ([r[i] * 1e3 for r in runs] for i in range(4))
    total = [sum(r[:4]) * 1e3 for r in runs]
    prompt = statistics.median(r[4] for r in runs)
    print(f"| {name} | {prompt / 1000:.1f}K | {'-' if new_tokens is None else f'{new_tokens / 1000:.1f}K'} "
          f"| {len(runs)} | {statistics.median(render):.2f} | {statistics.median(encode):.2f} "
          f"| {statistics.median(hashing):.2f} | {statistics.median(walk):.3f} | {statistics.median(total):.2f} "
          f"| {pct(total, 90):.2f} | {pct(total, 99):.2f} |")


def trace_rows(path: str, requests: int) -> None:
    """Each trace prompt tokenized and hashed in order, by one tokenizer that keeps what it saw (as the balancer)."""
    trace = load_trace(path)[:requests]
    prompts = [PromptMaker("precise-cost").prompt(r) for r in trace]
    seen: set[int] = set()
    new = total = 0
    for r in trace:  # the text no earlier prompt had: what any tokenizer must encode
        full = r.hash_ids[:r.input_length // BLOCK_TOKENS]
        new += len(set(full) - seen)
        total += len(full)
        seen.update(full)
    print(f"({new / total:.0%} of the prompts' whole blocks appear for the first time)")
    print(f"| trace | prompts | mean tokens | runs | tokenize ms median | chain ms | total median ms "
          f"| mean ms | p90 ms | p99 ms |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cut in (True, False):
        tokenizer = load_tokenizer(TOKENIZER_DIR)
        tokenizer.cuts_lines = cut and tokenizer.cuts_lines
        runs = []
        for prompt in prompts:
            t0 = time.perf_counter()
            tokens = tokenizer.prompt("completions", {"prompt": prompt})
            t1 = time.perf_counter()
            Matcher.chain(tokens, BLOCK)
            runs.append((t1 - t0, time.perf_counter() - t1, tokens.length))
        trace_row(path, "cut at line seams" if tokenizer.cuts_lines else "encoded whole", runs)
    waited, after = head_first(prompts)
    trace_row(path, "routing waits for the head", waited)
    trace_row(path, "(the rest, after routing)", after)


def trace_row(path: str, name: str, runs: list[tuple[float, float, int]]) -> None:
    total = [(a + b) * 1e3 for a, b, _ in runs]
    print(f"| {path.rsplit('/', 1)[-1]} | {name} | {statistics.mean(r[2] for r in runs) / 1000:.1f}K | {len(runs)} "
          f"| {statistics.median(r[0] for r in runs) * 1e3:.2f} | {statistics.median(r[1] for r in runs) * 1e3:.2f} "
          f"| {statistics.median(total):.2f} | {statistics.mean(total):.2f} | {pct(total, 90):.2f} "
          f"| {pct(total, 99):.2f} |", flush=True)


def head_first(prompts: list[str]) -> tuple[list[tuple[float, float, int]], list[tuple[float, float, int]]]:
    """Per prompt, (tokenize, chain + walk seconds, tokens) before routing and (tokenize + chain seconds, 0, tokens)
    after it, as the matcher splits them, in front of one engine that holds every earlier prompt."""
    matcher = Matcher(load_tokenizer(TOKENIZER_DIR), TokenIndex(1), 1.0)
    matcher.index.block_size[0] = BLOCK
    waited, after = [], []
    for prompt in prompts:
        t0 = time.perf_counter()
        head = matcher.tokenizer.head("completions", {"prompt": prompt})
        t1 = time.perf_counter()
        chains = {BLOCK: Matcher.chain(head.prompt, BLOCK)}
        now = head.rest is None or matcher.may_hold_more(matcher.index.held_chains(chains), chains)
        t2 = time.perf_counter()
        tokens, whole = matcher.finish(head, chains, [BLOCK])
        t3 = time.perf_counter()
        waited.append((t1 - t0 + (t3 - t2 if now else 0.0), t2 - t1, head.prompt.length if not now else tokens))
        after.append((0.0 if now else t3 - t2, 0.0, 0 if now else tokens - head.prompt.length))
        matcher.index.expect(0, whole[BLOCK], math.inf, 0.0)  # the engine computed it, and keeps it
    matcher.close()
    return waited, after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=115_000, help="prompt size (115000)")
    ap.add_argument("--repeat", type=int, default=300, help="warm-extend repetitions (300)")
    ap.add_argument("--cold-repeat", type=int, default=10, help="cold-prompt repetitions (10)")
    ap.add_argument("--quick", action="store_true", help="30 warm and 2 cold repetitions: a smoke run")
    ap.add_argument("--replicas", default=str(REPLICAS), help="comma-separated replica counts, each at least 8 (8)")
    ap.add_argument("--trace", help="a trace file: time its prompts instead (see above)")
    ap.add_argument("--trace-requests", type=int, default=1000, help="prompts of --trace to time (1000)")
    args = ap.parse_args()
    if args.trace:
        return trace_rows(args.trace, args.trace_requests)
    if args.quick:
        args.repeat, args.cold_repeat = 30, 2
    setup = time.perf_counter()
    counter = load_tokenizer(TOKENIZER_DIR)  # sizes the conversations; the measured tokenizer sees only requests
    *base, tools = conversation("precise-cost", args.tokens - 1700, counter)
    text = TextSource("precise-cost")
    extends = [body(base + [assistant(text, f"x{i}"), tool_result(text, f"y{i}", 1500)], tools)
               for i in range(args.repeat)]
    colds = []
    for i in range(args.cold_repeat):
        *messages, cold_tools = conversation(f"cold-{i}", args.tokens, counter)
        colds.append(body(messages, cold_tools))
    del counter
    print(f"(set-up {time.perf_counter() - setup:.1f} s)")
    print("| replicas | request | prompt tokens | new tokens | runs | render ms | tokenize ms | chain ms | walk ms "
          "| total median ms | p90 ms | p99 ms |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for replicas in (int(n) for n in args.replicas.split(",")):
        # A fresh tokenizer each time: what it remembers of earlier renderings is the balancer's, per conversation.
        tokenizer = load_tokenizer(TOKENIZER_DIR)  # what the balancer loads from RJ_TOKENIZER
        tokenizer.part_separator = " "  # as the balancer sets it for an SGLang engine; no request here has parts
        seen = tokenizer.encode_rendered(tokenizer.render_chat(body(base, tools)))  # the turn the balancer saw
        Matcher.chain(seen, BLOCK)
        previous = seen.ids
        index = filled_index(list(previous), random.Random(7), replicas)
        gc.collect()
        warm = [one(tokenizer, index, b) for b in extends]
        held = warm[-1][5]
        cold = [one(tokenizer, index, b) for b in colds]
        assert held[2].gpu_tokens > held[5].gpu_tokens > held[7].gpu_tokens > 0
        report(f"{replicas} | warm extend", warm, warm[-1][4] - len(previous))
        report(f"{replicas} | cold", cold, None)
        heads = load_tokenizer(TOKENIZER_DIR)  # the same again, routed on the head, by a tokenizer that saw as much
        heads.part_separator = " "
        Matcher.chain(heads.encode_rendered(heads.render_chat(body(base, tools))), BLOCK)
        matcher = Matcher(heads, index, 1.0)
        for name, requests in (("warm extend", extends), ("cold", colds)):
            runs = [one_head(matcher, b) for b in requests]
            report(f"{replicas} | {name}, head first", runs, None)
            print(f"|  | (its rest, after routing: median {statistics.median(r[6] for r in runs) * 1e3:.2f} ms, "
                  f"{sum(r[6] > 0 for r in runs)} of {len(runs)} routed before it) |", flush=True)
        matcher.close()
        median = statistics.median(sum(r[:4]) for r in warm) * 1e3
        print(f"|  | (warm extend median {median:.2f} ms against the 2 ms target: {'within' if median <= 2 else 'OVER'};"
              f" {sum(index.size(r) for r in range(replicas)):,} blocks indexed) |", flush=True)


if __name__ == "__main__":
    main()

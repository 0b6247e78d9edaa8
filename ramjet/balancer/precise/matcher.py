"""Request -> what each replica holds, by the engines' reports: tokenized as the engine will, off the event loop.

The tokenizer is the model's own (RJ_TOKENIZER), loaded here from a Hugging Face
directory; tokenizing and hashing run on a small thread pool so that one cold
115K-token prompt delays no other request's routing.

Routing waits only for the prompt's head (routing/prompt_tokens.py: a little way
into its first text never seen here). When no replica holds the head to its end, no
replica holds anything past it, so the match is already the whole prompt's: the rest
is tokenized after routing, on a thread of its own, for the blocks the request will
leave behind and for the next turn (measured on the synthetic trace, whose text is
82% new: docs/benchmarks.md). Only the share's denominator, the prompt's length, is
then estimated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from ramjet.routing.prompt_tokens import Head, Prompt, PromptTokenizer, TemplateError
from ramjet.routing.token_blocks import chain
from ramjet.routing.token_index import Held, TokenIndex
from ramjet.routing.units import reload_priced

TOKENIZER_THREADS = 2  # a cold 115K-token prompt must not hold up everyone else's tokenizing
MAX_RESTS = 32  # rests queued after routing, at most: past it a request's rest is tokenized before it is routed
log = logging.getLogger("ramjet.precise")

Chains = dict[int, list[int]]  # block size -> the prompt's chained block hashes


def load_tokenizer(path: str | Path, cache_tokens: int = 16_000_000) -> PromptTokenizer:
    """A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json with the chat template).

    The library's own thread pool is turned off (unless TOKENIZERS_PARALLELISM says otherwise): the
    balancer's tokenizing threads are its parallelism, and a rest tokenized after routing must stay on
    its own low-priority thread, not fan out over every core of a host it shares with the engine."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    path = Path(path)
    try:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # the tokenizers library raises its own exception types
        raise TemplateError(f"{path}: cannot load tokenizer.json: {e}") from None
    config: dict = {}
    if (path / "tokenizer_config.json").exists():
        try:
            config = json.loads((path / "tokenizer_config.json").read_text())
        except (OSError, ValueError) as e:
            raise TemplateError(f"{path / 'tokenizer_config.json'}: {e}") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    special = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[key] = value
    return PromptTokenizer(tokenizer, template, special, cache_tokens)


@dataclass(frozen=True, slots=True)
class Match:
    """One request seen through the engines' reports."""

    prompt_tokens: int                 # estimated while `rest` is pending (precise/matcher.py)
    held: list[Held]                   # what each replica holds of it (GPU, host tier)
    shares: list[float | None]         # the held share the router may use; None where the replica is not trusted
    chains: dict[int, list[int]]       # the block chain at each engine block size (of its head, while `rest`)
    known: list[bool]                  # whether a replica's block size was known: without it, no prediction
    removals: int = 0                  # the token index's eviction mark when it was matched
    rest: asyncio.Future | None = None  # (tokens, chains) of the whole prompt, tokenized after routing

    @property
    def whole(self) -> tuple[int, dict[int, list[int]]]:
        """The whole prompt's tokens and chains once known, else what routing used."""
        rest = self.rest
        if rest is not None and rest.done() and not rest.cancelled() and rest.exception() is None:
            return rest.result()
        return self.prompt_tokens, self.chains


class Matcher:
    """Request -> what each replica holds, tokenized off the event loop."""

    def __init__(self, tokenizer: PromptTokenizer, index: TokenIndex, host_credit: float):
        self.tokenizer = tokenizer
        self.index = index
        self.host_credit = host_credit
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="ramjet-tokenize")
        self._rests = ThreadPoolExecutor(1, thread_name_prefix="ramjet-tokenize-rest", initializer=_yielding)
        self.max_rests, self.rests = MAX_RESTS, 0  # the bound and how many are queued or running

    async def held(self, route: str, body: dict) -> tuple[int, list[Held], Chains, asyncio.Future | None]:
        """(prompt tokens, per replica what it holds, the prompt's chain per block size, the rest); ApiError if
        untokenizable. With a rest (a future of the whole prompt's tokens and chains), the chains are its head's
        and the tokens estimated."""
        loop = asyncio.get_running_loop()
        sizes = sorted({s for s in self.index.block_size if s})
        head, chains = await loop.run_in_executor(self._pool, self.head, route, body, sizes)
        held = self.index.held_chains(chains)
        if head.rest is None:
            return head.prompt.length, held, chains, None
        # Another balancer may have sent this text: match all of it now. So also when the rests fall behind:
        # what waits for them is bounded, and a sustained flood of new text is slowed as it was before.
        if self.rests >= self.max_rests or self.may_hold_more(held, chains):
            tokens, chains = await loop.run_in_executor(self._pool, self.finish, head, chains, sizes)
            return tokens, self.index.held_chains(chains), chains, None
        self.rests += 1
        rest = loop.run_in_executor(self._rests, self.finish, head, chains, sizes)
        rest.add_done_callback(self._rest_done)
        return head.estimated_tokens, held, chains, rest

    def _rest_done(self, rest: asyncio.Future) -> None:
        self.rests -= 1
        if not rest.cancelled() and rest.exception() is not None:
            log.warning("tokenizing a prompt's rest after routing failed: %r", rest.exception())

    def may_hold_more(self, held: list[Held], chains: Chains) -> bool:
        """Whether some replica holds (or is computing) the head's last block: then it may hold more."""
        for h, size in zip(held, self.index.block_size):
            if size in chains and max(h.tokens, h.reach_tokens) >= len(chains[size]) * size:
                return True
        return False

    def head(self, route: str, body: dict, sizes: list[int]) -> tuple[Head, Chains]:
        """The request's head and its chains (a worker thread's part before routing)."""
        head = self.tokenizer.head(route, body)
        return head, {size: self.chain(head.prompt, size) for size in sizes}

    def finish(self, head: Head, chains: Chains, sizes: list[int]) -> tuple[int, Chains]:
        """The whole prompt's tokens and chains, the head's hashes kept (before or after routing)."""
        prompt, tokens = head.finish(), head.prompt.length
        whole = {size: extend_chain(prompt, size, chains[size], tokens) for size in sizes}
        if prompt.rendering is not None:
            prompt.rendering.chains.update(whole)
        return prompt.length, whole

    @staticmethod
    def chain(prompt: Prompt, size: int) -> list[int]:
        """The prompt's block hashes, those of the blocks it shares with an earlier rendering taken from it."""
        reused = prompt.reused
        hashes = extend_chain(prompt, size, reused.base.chains.get(size, []) if reused else [],
                              reused.tokens if reused else 0)
        if prompt.rendering is not None:
            prompt.rendering.chains[size] = hashes
        return hashes

    def join_text_parts_with(self, separator: str) -> None:
        """How the engine joins a message's text parts: "\n" (vLLM, the default), " " (SGLang)."""
        self.tokenizer.part_separator = separator

    def shares(self, prompt_tokens: int, held: list[Held]) -> list[float]:
        """Each replica's held share of the prompt, a host-tier token worth `host_credit` of a GPU one."""
        if not prompt_tokens:
            return [0.0] * len(held)
        return [min(reload_priced(h.tokens, h.host_tokens, self.host_credit) / prompt_tokens, 1.0) for h in held]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._rests.shutdown(wait=False, cancel_futures=True)


def _yielding() -> None:
    """The rests' thread yields the CPU to everything else (the proxy, the heads, the engine's own processes on a
    shared host): Linux sets a nice value per thread. Elsewhere it runs at the process's priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def extend_chain(prompt: Prompt, size: int, earlier: list[int], earlier_tokens: int) -> list[int]:
    """The prompt's block hashes, those of its first `earlier_tokens` ids taken from `earlier` (hashed before:
    an earlier rendering's, or the head's)."""
    kept = min(len(earlier), earlier_tokens // size)
    return earlier[:kept] + chain(prompt.ids_from(kept * size), size, parent=earlier[kept - 1] if kept else None)


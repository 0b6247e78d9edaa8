"""The engine's own view of a prompt: token ids from a Hugging Face tokenizer, and page hashes.

This is the simulated engine's truth, deliberately independent of the balancer's
code: if the two disagreed about what a prompt is, the benchmark would show it
as lost cache hits, as it would against a real engine.

Speed: a Hugging Face byte-level BPE tokenizes about 1.5 MB/s per core here,
so a cold 115K-token prompt costs ~100 ms. Agents resend their whole
conversation every turn, so the text is cut into chunks right after a run of
line breaks (content-defined, so a prefix always cuts the same way) and each
chunk's ids are cached: a turn costs only its new text. The cut is exact only
for tokenizers whose pre-tokenizer splits after line-break runs first (the
shipped one, see tokenizer/build.py); any other tokenizer encodes whole texts.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import xxhash
from tokenizers import Tokenizer as HFTokenizer

from ramjet.sim.template import ChatTemplate, PromptError

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer")
_CHAIN_SEED = 0x5EED_0520
CHUNK_CHARS = 4096  # chunks end at the first line-break run after this many characters
CACHE_CHARS = 64 << 20  # text kept in the chunk cache (its ids take about the same again)

# The simulated model's output, one token per word (tokenizer/build.py makes each one token).
OUTPUT_WORDS = (" the", " model", " reads", " your", " code", " and", " writes", " a", " short", " answer",
                " about", " it", ".", " Then", " waits", ",")

__all__ = [
    "OUTPUT_WORDS",
    "SHIPPED_DIR",
    "Prompt",
    "PromptError",
    "Tokenizer",
    "load_tokenizer",
    "make_prompt",
    "page_hashes",
]


@dataclass(frozen=True)
class Prompt:
    ids: array  # token ids ("I": 32-bit unsigned)
    hashes: list[int]  # chained hash of each full page; hashes[i] names tokens [0, (i+1)*page)
    seed: int  # stable per prompt, for deterministic output lengths

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def matchable_pages(self, page: int) -> int:
        """Pages a cache may serve: as in SGLang, the last token is always computed."""
        return min(len(self.hashes), (len(self.ids) - 1) // page) if self.ids else 0


def page_hashes(ids: array, page: int, start: int = 0, parent: int | None = None) -> list[int]:
    """Chained xxh3 of each full page of `ids` from page `start` on (`parent`: the hash before it)."""
    data = memoryview(ids.tobytes())
    size = page * ids.itemsize
    digest = xxhash.xxh3_64_intdigest
    h = _CHAIN_SEED if parent is None else parent
    out = []
    for offset in range(start * size, (len(ids) // page) * size, size):
        h = digest(data[offset:offset + size], h)
        out.append(h)
    return out


def make_prompt(ids: array, page: int) -> Prompt:
    return Prompt(ids, page_hashes(ids, page), xxhash.xxh3_64_intdigest(ids.tobytes()))


def _chunkable(spec: dict) -> bool:
    """True when cutting after a line-break run cannot change the tokenization (see module doc)."""
    pre = spec.get("pre_tokenizer") or {}
    first = (pre.get("pretokenizers") or [{}])[0] if pre.get("type") == "Sequence" else {}
    return (spec.get("normalizer") is None and spec.get("post_processor") is None
            and first.get("type") == "Split" and first.get("pattern") == {"Regex": "\n+"}
            and first.get("behavior") == "MergedWithPrevious"
            and not any("\n" in t.get("content", "") or t.get("lstrip") or t.get("rstrip")
                        for t in spec.get("added_tokens") or []))


def _cuts(text: str) -> list[int]:
    """Chunk ends: the first end of a line-break run at or after every CHUNK_CHARS characters."""
    cuts = []
    pos, n = 0, len(text)
    while pos < n:
        nl = text.find("\n", pos + CHUNK_CHARS - 1)
        if nl < 0:
            break
        end = nl + 1
        while end < n and text[end] == "\n":
            end += 1
        if end >= n:
            break
        cuts.append(end)
        pos = end
    cuts.append(n)
    return cuts


class Tokenizer:
    """A Hugging Face tokenizer directory: `tokenizer.json`, its special tokens and chat template."""

    def __init__(self, directory: str = SHIPPED_DIR):
        self.directory = directory
        with open(os.path.join(directory, "tokenizer.json"), encoding="utf-8") as f:
            raw = f.read()
        spec = json.loads(raw)
        self.hf = HFTokenizer.from_str(raw)
        self.chunked = _chunkable(spec)
        self.template = ChatTemplate.from_directory(directory)
        eos = self.template.specials.get("eos_token")
        self.eos_id = self.hf.token_to_id(eos) if eos else None
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> array:
        """Token ids of `text`; thread-safe (the server runs large prompts off its event loop)."""
        if not text:
            return array("I")
        if not self.chunked:
            return array("I", self.hf.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)
        cuts = _cuts(text)
        chunks = [text[a:b] for a, b in zip([0, *cuts[:-1]], cuts)]
        with self._lock:
            found = [self._cache.get(c) for c in chunks]
            for c, ids in zip(chunks, found):
                if ids is not None:
                    self._cache.move_to_end(c)
        missing = [c for c, ids in zip(chunks, found) if ids is None]
        if missing:  # one batch: the library spreads it over the cores and releases the GIL
            fresh = iter([array("I", e.ids) for e in self.hf.encode_batch_fast(missing, add_special_tokens=False)])
            found = [ids if ids is not None else next(fresh) for ids in found]
            with self._lock:
                for c, ids in zip(chunks, found):
                    if c not in self._cache:
                        self._cache[c] = ids
                        self._cached_chars += len(c)
                while self._cached_chars > CACHE_CHARS and self._cache:
                    c, _ = self._cache.popitem(last=False)
                    self._cached_chars -= len(c)
        out = array("I")
        for ids in found:
            out.extend(ids)
        return out

    def uncached_chars(self, text: str) -> int:
        """About how much of `text` is new to the chunk cache (decides whether to leave the event loop)."""
        if not self.chunked:
            return len(text)
        cuts = _cuts(text)
        with self._lock:
            return sum(b - a for a, b in zip([0, *cuts[:-1]], cuts) if text[a:b] not in self._cache)

    def render(self, body: dict) -> str:
        return self.template.render(body)

    def decode(self, ids) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def word_ids(self, words: list[str]) -> list[int]:
        """One id per output word (its first token: with the shipped tokenizer every word is one token)."""
        return [(self.hf.encode(w, add_special_tokens=False).ids or [0])[0] for w in words]


@functools.lru_cache(maxsize=8)
def load_tokenizer(directory: str | None = None) -> Tokenizer:
    """One shared Tokenizer per directory (None: the shipped one); loading takes a few tens of ms."""
    return Tokenizer(directory or SHIPPED_DIR)


def ids_prompt(value: list) -> array:
    """Token ids given by the client (`input_ids`, or a completions prompt of ids), used as given."""
    if not value or not all(type(t) is int for t in value):
        raise PromptError("token ids must be a non-empty list of integers")
    try:
        return array("I", value)
    except OverflowError:
        raise PromptError("token ids must be between 0 and 2**32 - 1") from None


def single_prompt(value, field: str) -> str | list[int]:
    """A completions `prompt` or `/generate` `text`/`input_ids`: one text or one id list."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise PromptError(f"'{field}' must not be empty")
        return value
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        ids_prompt(value)  # range check now: a 400 before anything is queued
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, str | list) for v in value):
        raise PromptError(f"batched '{field}' is not supported by the simulator; send one prompt")
    raise PromptError(f"'{field}' must be a string or a list of token ids")

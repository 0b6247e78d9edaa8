"""A request -> the token ids the engine will compute: its chat template rendered as the engine does, tokenized.

Precise routing matches a request against the blocks an engine reports it
holds, and those are blocks of token ids; so the balancer must produce the
same ids. Engines render chat with the model's Hugging Face chat template
(ramjet.routing.chat_template) and tokenize the result without adding special
tokens; completions prompts are tokenized with them.

Tokenizing is incremental. A rendered chat prompt takes the token ids of the
earlier rendering it shares the most text with (ramjet.routing.renderings), up
to the last special token both share: the tokenizer never merges across a
special token, so those ids are the ones a whole encode would give. What
follows is cut at special tokens too, and each piece is tokenized once and
cached, so a template that rewrites earlier turns (dropping old reasoning)
re-tokenizes only the pieces it changed. Where the tokenizer allows it
(ramjet.routing.text_seams), long text between special tokens is cut again at
plain line breaks, so a long single message or completions prompt that extends
an earlier one is tokenized only where it is new.

Tokenizing stops early on request (`head`): a little way into the first piece
this tokenizer never saw. An engine holds a prefix only if that prefix was sent
to it, so past new text it holds nothing, unless the text reached it another way
(another balancer, a client sending directly): the caller walks the head and
finishes the rest before routing only when some replica holds the head to its end.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import jinja2
import xxhash
from tokenizers import Tokenizer

from ramjet.errors import bad_request
from ramjet.routing import text_seams
from ramjet.routing.chat_template import compile_template
from ramjet.routing.renderings import Rendering, Renderings, Reuse, checkpoints, first_ids


HEAD_NEW_CHARS = 512  # new text a head takes, at least: a few blocks, so that its last one holds some of it


class TemplateError(ValueError):
    """The tokenizer directory or its chat template cannot be used."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's token ids; for a chat prompt, its rendering (kept for the next turn) and what it reused."""

    segments: list[array]               # its token ids, in order; more than one when they extend a rendering
    rendering: Rendering | None = None  # its `chains` are the caller's to fill
    reused: Reuse | None = None         # the earlier rendering whose first `reused.tokens` ids these are

    @property
    def length(self) -> int:
        return sum(map(len, self.segments))

    def ids_from(self, start: int) -> array:
        """Token ids from `start` on, in one array (only those are copied)."""
        out = array("I")
        for segment in self.segments:
            if start >= len(segment):
                start -= len(segment)
            else:
                out.extend(segment[start:] if start else segment)
                start = 0
        return out

    @property
    def ids(self) -> array:
        return self.ids_from(0)


@dataclass(slots=True)
class Head:
    """A request's leading token ids, a little way into the first text this tokenizer never saw; `finish` gives
    them all."""

    prompt: Prompt                  # the head's ids; the whole prompt, rendering included, when `rest` is None
    rest_chars: int = 0             # characters after the head
    head_chars: int = 0             # characters the head's ids cover
    rest: Callable[[], Prompt] | None = None

    @property
    def estimated_tokens(self) -> int:
        """The whole prompt's length: exact when nothing is left, else the rest at the head's characters a token."""
        n = self.prompt.length
        return n + round(self.rest_chars * n / self.head_chars) if self.rest and self.head_chars else n

    def finish(self) -> Prompt:
        """The whole prompt's ids (a chat prompt's rendering is kept for the next turn only now)."""
        return self.prompt if self.rest is None else self.rest()


class PieceCache:
    """Token ids of rendered pieces, by content, least recently used first out; bounded in tokens.

    Used by the matcher's worker threads at once, so its count and its order change under a lock."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens = 0
        self._pieces: OrderedDict[int, array] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: int) -> array | None:
        with self._lock:
            found = self._pieces.get(key)
            if found is not None:
                self._pieces.move_to_end(key)
            return found

    def put(self, key: int, ids: array) -> None:
        with self._lock:
            old = self._pieces.get(key)
            self._pieces[key] = ids
            self.tokens += len(ids) - (len(old) if old is not None else 0)
            while self.tokens > self.max_tokens and len(self._pieces) > 1:
                _, gone = self._pieces.popitem(last=False)
                self.tokens -= len(gone)


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special: dict[str, str],
                 cache_tokens: int = 16_000_000, rendering_size: int = 128 * 1024 * 1024):
        self.tokenizer = tokenizer
        self.template = compile_template(chat_template) if chat_template else None
        self.special = special  # bos_token, eos_token, ...: what templates read
        self.part_separator = "\n"  # text parts of one message are joined with this: "\n" (vLLM), " " (SGLang)
        self.cache = PieceCache(cache_tokens)
        splitters = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values()
                            if t.special and not (t.lstrip or t.rstrip or t.single_word)), key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, splitters)) + ")") if splitters else None
        # Reusing ids up to a special token is exact unless one special token holds another past its start
        # (then a match could begin before the cut and end after it): such tokenizers go piece by piece.
        nested = any(a != b and b in a[1:] for a in splitters for b in splitters)
        self.renderings = Renderings(rendering_size) if splitters and not nested else None
        # Without offsets where the library offers it: a fifth faster, the same ids.
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self.cuts_lines = text_seams.cuttable(tokenizer)
        self._wrapping = text_seams.wrapping(tokenizer)  # what adding special tokens puts around a text's ids

    # --- rendering -------------------------------------------------------------
    def render_chat(self, body: dict) -> str:
        if self.template is None:
            raise bad_request("the model's tokenizer has no chat template")
        kwargs = body.get("chat_template_kwargs")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        generation = body.get("add_generation_prompt", True)
        try:
            return self.template.render(messages=_messages(body.get("messages"), self.part_separator),
                                        tools=body.get("tools"), add_generation_prompt=generation is not False,
                                        **{**self.special, **kwargs})
        except jinja2.exceptions.TemplateError as e:
            raise bad_request(f"the chat template refused this conversation: {e}") from None

    # --- tokenizing ---------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> array:
        """Token ids of `text`, piece by piece through the cache (the same ids as one encode of the whole).

        With `add_special_tokens` (a completions prompt: the tokenizer's post-processor may add a BOS)
        the pieces' ids get what the post-processor puts around them, or, when it does more than that,
        the text is encoded whole, uncached. Always through the batch call: the library's single `encode`
        holds the interpreter lock throughout (measured: 1.9 s for 600K tokens, the event loop stopped for
        all of it), its batch call lets the loop run meanwhile.
        """
        return self._text_head(text, add_special_tokens, stop=False).prompt.ids

    def encode_rendered(self, text: str) -> Prompt:
        """A rendered chat prompt's ids, reusing those of the earlier rendering that shares the most of it."""
        return self.rendered_head(text, stop=False).finish()

    def _text_head(self, text: str, add_special_tokens: bool, stop: bool = True) -> Head:
        if add_special_tokens and self._wrapping is None:
            return Head(Prompt([array("I", self._encode_batch([text], add_special_tokens=True)[0].ids)]))
        before, after = self._wrapping if add_special_tokens else ((), ())  # most tokenizers add nothing
        ids, used = self._pieces(text, stop=stop)
        if before:
            ids = array("I", before) + ids
        if used == len(text):
            return Head(Prompt([ids + array("I", after) if after else ids]))

        def rest() -> Prompt:
            more = self._pieces(text[used:])[0]
            return Prompt([ids, more + array("I", after) if after else more])
        return Head(Prompt([ids]), len(text) - used, used, rest)

    def rendered_head(self, text: str, stop: bool = True) -> Head:
        """A rendered chat prompt's head (`head`), with the ids of the earlier rendering sharing the most of it."""
        if self.renderings is None:
            return self._text_head(text, False, stop)
        marks = checkpoints(text, self.renderings.stride)
        reuse = self.renderings.find(text, marks)
        start, tokens, cuts, cut_tokens = 0, 0, [], []
        if reuse is not None:
            start, tokens = reuse.chars, reuse.tokens
            cuts, cut_tokens = reuse.base.cuts[:reuse.cut + 1], reuse.base.cut_tokens[:reuse.cut + 1]
        reused = first_ids(reuse.base.segments, tokens) if reuse is not None else []  # no copy
        ids, used = self._pieces(text[start:], stop, start, cuts, cut_tokens, tokens)
        done = start + used

        def whole(more: array | None) -> Prompt:
            segments = reused + [ids] + ([more] if more else [])
            rendering = Rendering(text, segments, cuts, cut_tokens, marks)
            self.renderings.add(rendering, reuse)
            return Prompt(segments, rendering, reuse)
        if done == len(text):
            return Head(whole(None))
        return Head(Prompt(reused + [ids], None, reuse), len(text) - done, done,
                    lambda: whole(self._pieces(text[done:], False, done, cuts, cut_tokens, tokens + len(ids))[0]))

    def _pieces(self, text: str, stop: bool = False, offset: int = 0, cuts: list[int] | None = None,
                cut_tokens: list[int] | None = None, before: int = 0) -> tuple[array, int]:
        """The ids of `text`, piece by piece, and the characters they cover: all of it, or with `stop` up to
        HEAD_NEW_CHARS past the start of the first piece not in the cache. With `cuts`, note where each
        special token ends, in characters after `offset` and in tokens after `before`."""
        missing: list[tuple[int, str]] = []
        found: list[array | int] = []
        ends: list[tuple[int, bool]] = []  # where each piece ends, and whether it is a special token
        used, new_from = 0, None  # characters so far; where the first piece not in the cache began
        for piece, special in self._cut(text):
            key = xxhash.xxh3_64_intdigest(piece.encode("utf-8", "surrogatepass"))
            ids = self.cache.get(key)
            if ids is None:
                missing.append((key, piece))
                found.append(key)
                new_from = used if new_from is None else new_from
            else:
                found.append(ids)
            used += len(piece)
            ends.append((offset + used, special))
            if stop and new_from is not None and used - new_from >= HEAD_NEW_CHARS:
                break
        if missing:
            encoded = self._encode_batch([p for _, p in missing], add_special_tokens=False)
            fresh = {key: array("I", e.ids) for (key, _), e in zip(missing, encoded)}
            for key, ids in fresh.items():
                self.cache.put(key, ids)
            found = [fresh[x] if isinstance(x, int) else x for x in found]
        out = array("I")
        for ids, (end, special) in zip(found, ends):
            out.extend(ids)
            if special and cuts is not None:
                cuts.append(end)
                cut_tokens.append(before + len(out))
        return out, used

    def _cut(self, text: str):
        """(piece, is a special token) in order: cut at special tokens, then long text at line seams."""
        pieces = self._split.split(text) if self._split else [text]
        for n, piece in enumerate(pieces):
            if n % 2:  # split() puts the special tokens at odd places
                yield piece, True
            elif self.cuts_lines and len(piece) > text_seams.EVERY:
                for part in text_seams.pieces(piece):
                    yield part, False
            elif piece:
                yield piece, False

    def prompt(self, route: str, body: dict) -> Prompt:
        """The token ids the engine computes for this request; ApiError (400) when it cannot be known."""
        return self.head(route, body).finish()

    def head(self, route: str, body: dict) -> Head:
        """This request's ids through its first new text (module docstring); ApiError (400) as `prompt`."""
        if route == "chat":
            return self.rendered_head(self.render_chat(body))
        if route == "generate":
            if isinstance(body.get("input_ids"), list):
                return Head(Prompt([_ids(body["input_ids"])]))
            text = body.get("text")
            if isinstance(text, str):
                return self._text_head(text, add_special_tokens=True)
            raise bad_request("'text' must be a string or 'input_ids' a list of token ids", "text")
        if route == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return self._text_head(prompt, add_special_tokens=True)
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return Head(Prompt([_ids(prompt)]))
            raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
        raise bad_request(f"precise routing does not tokenize {route} requests")


def _ids(values: list) -> array:
    try:
        return array("I", values)
    except (TypeError, OverflowError):
        raise bad_request("token ids must be integers between 0 and 2**32 - 1", "input_ids") from None


def _messages(messages: object, separator: str) -> list:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise bad_request("'messages' must be a list of objects", "messages")
    return [_as_engines_see_it(m, separator) for m in messages]


def _as_engines_see_it(message: dict, separator: str) -> dict:
    """Fields set to null are left out, and text parts joined, as the engines prepare messages for a template."""
    out = {k: v for k, v in message.items() if v is not None}
    content = out.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        out["content"] = separator.join(str(p.get("text", "")) for p in content)
    return out

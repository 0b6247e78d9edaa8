"""A request -> the token ids the engine will compute: its chat template rendered as the engine does, tokenized.

Precise routing matches a request against the blocks an engine reports it
holds, and those are blocks of token ids; so the balancer must produce the
same ids. Engines render chat with the model's Hugging Face chat template
(`apply_chat_template` semantics: a sandboxed jinja2 environment with
`trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` filter and the
`raise_exception` / `strftime_now` globals) and tokenize the result without
adding special tokens; completions prompts are tokenized with them.

Tokenizing is incremental: the rendered text is cut at the tokenizer's special
tokens, which the tokenizer never merges across, and each piece is tokenized
once and cached, so the next turn of a conversation only tokenizes what it
added, and a template that rewrites earlier turns just produces new pieces.
"""

from __future__ import annotations

import json
import re
from array import array
from collections import OrderedDict
from datetime import datetime

import jinja2
import jinja2.ext
import xxhash
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ramjet.errors import bad_request


class TemplateError(ValueError):
    """The tokenizer directory or its chat template cannot be used."""


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class PieceCache:
    """Token ids of rendered pieces, by content, least recently used first out; bounded in tokens."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens = 0
        self._pieces: OrderedDict[int, array] = OrderedDict()

    def get(self, key: int) -> array | None:
        found = self._pieces.get(key)
        if found is not None:
            self._pieces.move_to_end(key)
        return found

    def put(self, key: int, ids: array) -> None:
        self._pieces[key] = ids
        self.tokens += len(ids)
        while self.tokens > self.max_tokens and len(self._pieces) > 1:
            _, old = self._pieces.popitem(last=False)
            self.tokens -= len(old)


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special: dict[str, str],
                 cache_tokens: int = 16_000_000):
        self.tokenizer = tokenizer
        self.template = compile_template(chat_template) if chat_template else None
        self.special = special  # bos_token, eos_token, ...: what templates read
        self.part_separator = "\n"  # text parts of one message are joined with this: "\n" (vLLM), " " (SGLang)
        self.cache = PieceCache(cache_tokens)
        splitters = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values()
                            if t.special and not (t.lstrip or t.rstrip or t.single_word)), key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, splitters)) + ")") if splitters else None

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
        the text is encoded whole, uncached.
        """
        if add_special_tokens:
            return array("I", self.tokenizer.encode(text, add_special_tokens=True).ids)
        pieces = self._split.split(text) if self._split else [text]
        out = array("I")
        missing: list[tuple[int, str]] = []
        found: list[array | int] = []
        for piece in pieces:
            if not piece:
                continue
            key = xxhash.xxh3_64_intdigest(piece.encode("utf-8", "surrogatepass"))
            ids = self.cache.get(key)
            if ids is None:
                missing.append((key, piece))
                found.append(key)
            else:
                found.append(ids)
        if missing:
            encoded = self.tokenizer.encode_batch([p for _, p in missing], add_special_tokens=False)
            fresh = {key: array("I", e.ids) for (key, _), e in zip(missing, encoded)}
            for key, ids in fresh.items():
                self.cache.put(key, ids)
            found = [fresh[x] if isinstance(x, int) else x for x in found]
        for ids in found:
            out.extend(ids)
        return out

    def prompt_ids(self, route: str, body: dict) -> array:
        """The token ids the engine computes for this request; ApiError (400) when it cannot be known."""
        if route == "chat":
            return self.encode(self.render_chat(body))
        if route == "generate":
            if isinstance(body.get("input_ids"), list):
                return _ids(body["input_ids"])
            text = body.get("text")
            if isinstance(text, str):
                return self.encode(text, add_special_tokens=True)
            raise bad_request("'text' must be a string or 'input_ids' a list of token ids", "text")
        if route == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return self.encode(prompt, add_special_tokens=True)
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return _ids(prompt)
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

"""Prompts for a trace: one deterministic 512-token block of text per hash id.

Prefix sharing in the simulator is by token pages of the prompt, so a shared run
of `hash_ids` must give exactly a shared run of tokens. Text is built from pieces
that are one token each in the simulator's shipped tokenizer and that no
tokenizer merge can join: words of lower-case letters with their leading space
(" word", one pre-token each under GPT-2's byte-level split) and a line break
(its own pre-token; the tokenizer first cuts after every line break). So the
token count of a text is its number of pieces, and any concatenation or cut at a
piece boundary tokenizes as the concatenation or cut of the pieces' tokens.

A block is 512 pieces: a header of HEADER_WORDS words spelling the hash id in
base len(vocabulary) (least significant digit first), then words drawn by a
generator seeded with (salt, id), with a line break as every 16th piece (the
last piece of a block is one), so the simulator's tokenizer cache cuts long
prompts into lines. A prompt is the blocks of its `hash_ids` joined and cut to
`input_length` pieces.

Exactness, with the shipped tokenizer: a prompt has exactly `input_length`
tokens; two prompts whose `hash_ids` share k leading blocks share exactly their
first 512k tokens (fewer if one of them ends inside those blocks), and the next
block's headers differ within HEADER_WORDS tokens (ids that differ modulo the
vocabulary size, as neighbouring ids do, differ at the block's first token). In
pages that divide 512 and hold at least HEADER_WORDS tokens (the simulator's 64)
they share exactly k blocks' pages. Other tokenizers
(`ramjet sim --tokenizer`, a real engine) keep the exact text prefix, not the
exact token counts.
"""

from __future__ import annotations

import functools
import random
import re

from ramjet.bench.trace_load import BLOCK_TOKENS, TraceRequest

HEADER_WORDS = 3
LINE_PIECES = 16  # every 16th piece is a line break
VOCABULARY_SIZE = 1024  # distinct words; HEADER_WORDS of them name 1024**3 (1.07e9) ids
NEWLINE = "\n"
_WORD_TOKEN = re.compile(r"\u0120[a-z]{2,5}")  # " word" as byte-level BPE spells it; short: ~5 bytes a token


@functools.lru_cache(maxsize=1)
def shipped_vocabulary() -> tuple[str, ...]:
    """VOCABULARY_SIZE words (" word") that the simulator's shipped tokenizer encodes as one token each.

    Read from the tokenizer itself (words of 2-5 letters, in id order), and each checked by encoding it.
    """
    from ramjet.sim.tokens import (
        load_tokenizer,  # the simulator's tokenizer: bench may read it, not the reverse
    )
    hf = load_tokenizer().hf
    words = []
    for token, ident in sorted(hf.get_vocab().items(), key=lambda kv: kv[1]):
        if _WORD_TOKEN.fullmatch(token):
            word = " " + token[1:]
            if hf.encode(word, add_special_tokens=False).ids == [ident]:
                words.append(word)
        if len(words) == VOCABULARY_SIZE:
            return tuple(words)
    raise RuntimeError(f"the shipped tokenizer has only {len(words)} one-token words; need {VOCABULARY_SIZE}")


def chars_per_token(vocabulary: tuple[str, ...] | None = None) -> float:
    """Characters of trace text per token (about 4.6, against the swarm's 4): a peer's approximate tree counts
    characters, so a peer gets the KV capacity hint as a rank's tokens times this."""
    vocabulary = vocabulary or shipped_vocabulary()
    word = sum(map(len, vocabulary)) / len(vocabulary)
    return (word * (LINE_PIECES - 1) + len(NEWLINE)) / LINE_PIECES


def header(hash_id: int, vocabulary: tuple[str, ...]) -> list[str]:
    """The id in base len(vocabulary), least significant digit first, HEADER_WORDS words."""
    base = len(vocabulary)
    if not 0 <= hash_id < base ** HEADER_WORDS:
        raise ValueError(f"hash id {hash_id} does not fit {HEADER_WORDS} words of a {base}-word vocabulary")
    out = []
    for _ in range(HEADER_WORDS):
        hash_id, digit = divmod(hash_id, base)
        out.append(vocabulary[digit])
    return out


def block_pieces(hash_id: int, salt: str, vocabulary: tuple[str, ...]) -> list[str]:
    """The 512 one-token pieces of the block named `hash_id` (always the same for the same salt)."""
    pieces = header(hash_id, vocabulary)
    words = random.Random(f"ramjet-trace:{salt}:{hash_id}").choices(vocabulary, k=BLOCK_TOKENS)
    for i in range(len(pieces), BLOCK_TOKENS):
        pieces.append(NEWLINE if i % LINE_PIECES == LINE_PIECES - 1 else words[i])
    return pieces


class PromptMaker:
    """Prompts of one replay (one salt); keeps the text of the most recently used blocks."""

    def __init__(self, salt: str = "", vocabulary: tuple[str, ...] | None = None, cached_blocks: int = 8192):
        self.salt = salt
        self.vocabulary = vocabulary or shipped_vocabulary()
        self._block = functools.lru_cache(maxsize=cached_blocks)(self._block_text)

    def _block_text(self, hash_id: int) -> str:
        return "".join(block_pieces(hash_id, self.salt, self.vocabulary))

    def text(self, hash_ids: tuple[int, ...] | list[int], input_length: int) -> str:
        """The blocks of `hash_ids` joined, the last cut so the prompt is `input_length` pieces (tokens)."""
        if not 0 < input_length <= BLOCK_TOKENS * len(hash_ids):
            raise ValueError(f"input_length {input_length} does not fit {len(hash_ids)} blocks")
        full, rest = divmod(input_length, BLOCK_TOKENS)
        parts = [self._block(h) for h in hash_ids[:full]]
        if rest:
            parts.append("".join(block_pieces(hash_ids[full], self.salt, self.vocabulary)[:rest]))
        return "".join(parts)

    def prompt(self, req: TraceRequest) -> str:
        return self.text(req.hash_ids, req.input_length)

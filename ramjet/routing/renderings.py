"""Recent rendered prompts with their token ids, found again by the longest byte-identical prefix.

An agent's next turn is its last prompt plus a few new messages, so its rendering
starts with the text of a rendering seen one turn earlier (or, for a new session,
with another session's harness). Finding that rendering lets the tokenizer reuse
its token ids up to the last special token both share and tokenize only the rest,
and lets the caller reuse the block hashes of those tokens (`Rendering.chains`).

Renderings are found through checkpoints: every `stride` characters, a running
hash of the WINDOW characters before that point. The deepest checkpoint a new
rendering shares names a candidate (sampling keeps this cheap: a prompt is never
copied or encoded whole); string comparisons then find exactly where the two
part, so a candidate that only looked alike costs reuse, never a wrong id.
Bounded in size, least recently used first out; a rendering that the next one
extends whole is replaced by it. Safe to use from several threads.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

STRIDE = 16 * 1024  # characters between checkpoints
WINDOW = 256        # characters hashed at each checkpoint


@dataclass(eq=False, slots=True)
class Rendering:
    text: str                    # the rendered prompt
    segments: list[array]        # its token ids, in segments shared with the renderings it extends (read-only)
    cuts: list[int]              # character offsets just after each special token, ascending
    cut_tokens: list[int]        # token ids before each cut
    marks: list[int]             # checkpoint hashes at stride, 2 x stride, ... characters
    chains: dict[int, list[int]] = field(default_factory=dict)  # block size -> chained hashes, set by the caller

    @property
    def cost(self) -> int:
        """About its size in bytes (shared segments counted in full: an upper bound)."""
        return len(self.text) + 4 * sum(map(len, self.segments))


def first_ids(segments: list[array], n: int) -> list[array]:
    """The first `n` token ids of `segments`, as segments: whole ones shared, the last one cut."""
    out = []
    for segment in segments:
        if n >= len(segment):
            out.append(segment)
            n -= len(segment)
        else:
            if n:
                out.append(segment[:n])
            break
    return out


@dataclass(frozen=True, slots=True)
class Reuse:
    """What a new rendering may take from an earlier one: everything before its `cut`-th cut."""

    base: Rendering
    cut: int  # index into base.cuts; base.cuts[cut] characters and base.cut_tokens[cut] tokens are shared

    @property
    def chars(self) -> int:
        return self.base.cuts[self.cut]

    @property
    def tokens(self) -> int:
        return self.base.cut_tokens[self.cut]


def checkpoints(text: str, stride: int = STRIDE) -> list[int]:
    """At each whole multiple of `stride` characters, a hash of the WINDOW before it chained to the last."""
    out = []
    h = 0
    for end in range(stride, len(text) + 1, stride):
        h = xxhash.xxh3_64_intdigest(text[max(end - WINDOW, 0):end].encode("utf-8", "surrogatepass"), h)
        out.append(h)
    return out


def shared_chars(a: str, b: str, stride: int = STRIDE) -> int:
    """Length of the common prefix of `a` and `b` (in strides, then by halves: no string is copied whole)."""
    end = min(len(a), len(b))
    p = 0
    while p + stride <= end and a.startswith(b[p:p + stride], p):
        p += stride
    lo, hi = p, min(p + stride, end)  # a[:lo] == b[:lo]; they part at or before hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(b[p:mid], p):
            lo = mid
        else:
            hi = mid - 1
    return lo


class Renderings:
    def __init__(self, max_size: int, stride: int = STRIDE):
        self.max_size = max_size
        self.stride = stride
        self.size = 0
        self._lru: OrderedDict[int, Rendering] = OrderedDict()  # id() -> rendering
        self._at: dict[int, Rendering] = {}  # checkpoint hash -> the latest rendering with that prefix
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def find(self, text: str, marks: list[int]) -> Reuse | None:
        """The earlier rendering sharing the most of `text` (at least one stride), cut at a special token."""
        with self._lock:
            for k in range(len(marks) - 1, -1, -1):
                base = self._at.get(marks[k])
                if base is not None:
                    self._lru.move_to_end(id(base))
                    break
            else:
                return None
        cut = bisect_right(base.cuts, shared_chars(text, base.text, self.stride)) - 1
        return Reuse(base, cut) if cut >= 0 else None

    def add(self, rendering: Rendering, reused: Reuse | None = None) -> None:
        """Keep `rendering`; the one it reused goes if `rendering` extends all of it (it is found instead)."""
        with self._lock:
            if reused is not None and rendering.text.startswith(reused.base.text):
                self._drop(reused.base)
            for mark in rendering.marks:
                self._at[mark] = rendering
            self._lru[id(rendering)] = rendering
            self.size += rendering.cost
            while self.size > self.max_size and len(self._lru) > 1:
                self._drop(next(iter(self._lru.values())))

    def _drop(self, rendering: Rendering) -> None:
        if self._lru.pop(id(rendering), None) is None:
            return
        self.size -= rendering.cost
        for mark in rendering.marks:
            if self._at.get(mark) is rendering:
                del self._at[mark]

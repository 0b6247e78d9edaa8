"""Filler text for the simulated team, and its sizing: a token is 4 bytes of text.

The generator sizes every text as 4 bytes per token and keeps its own estimate
of each prompt's size, so the workload's shape (including when compaction
happens) never depends on the server's tokenizer. The text follows the salt:
two salts never share a cached prefix.
"""

from __future__ import annotations

import functools
import hashlib
import random

BYTES_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 6  # role markers and separators a chat template adds per message

# A small vocabulary with code-ish and prose words; entries with punctuation and
# line breaks make the filler look like prose/code without any escaping cost.
_WORDS = (
    "the a an of to in for on with from by at as is are was be been this that these those it its "
    "we you they he she our your their not no yes and or but if then else when while return yield "
    "def class import from self none true false null value values key keys item items list dict set "
    "map filter reduce sort sorted index length size count total sum min max mean median error errors "
    "warning info debug trace log logger config settings option options flag flags path paths file "
    "files dir directory module package function method argument arguments parameter result results "
    "request response client server router engine cache prefix token tokens block blocks hash rank "
    "replica replicas load score weight test tests assert check verify build run start stop restart "
    "update create delete read write open close parse format render template message messages prompt "
    "session agent task tool tools call calls output input stream buffer queue worker thread async await "
    "timeout retry failover health probe metric metrics label counter gauge histogram bucket latency "
    "throughput memory disk network socket port host address header headers body json yaml toml "
    "schema field fields type types string integer number boolean array object optional required "
    "default minimum maximum pattern enum description name names id ids version release branch commit "
    "merge diff patch review issue bug fix feature refactor rename move copy remove add change changes "
    "line lines column row rows table tables query database index migration user users team repo "
    "repository project source code docs readme example examples case cases edge state status step "
    "steps plan next previous first last new old current local remote global shared private public "
    "fast slow small large short long simple complex safe unsafe valid invalid empty full ready done "
    "0 1 2 3 4 8 16 32 64 128 256 512 1024 2048 4096 x y z i j k n m "
    "foo() bar() baz() get() put() len() str() int() dict() list() (self) [0] [i] {} => -> == != <= >= += "
    "error: warning: note: todo: fixme: def: class: return: "
    "it. done. ok. fails. passes. works. returns. expected. found. missing. changed. "
    "first, then, also, however, because, so, and, but, "
).split()
_WORDS_WITH_BREAKS = _WORDS + ["done.\n", "ok.\n", "}\n", ")\n", "\n\n", "-\n", "passes.\n", "returns.\n"]
_CORPUS_BYTES = 1 << 20


@functools.lru_cache(maxsize=8)
def _corpus(salt: str) -> str:
    """About 1 MiB of filler text, unique to `salt`, doubled so any slice up to 1 MiB needs no wrap."""
    rng = random.Random(f"ramjet-bench-corpus:{salt}")
    words = rng.choices(_WORDS_WITH_BREAKS, k=_CORPUS_BYTES // 4)
    text = " ".join(words).encode("ascii")[:_CORPUS_BYTES].decode("ascii")
    if len(text) < _CORPUS_BYTES:  # pragma: no cover - the vocabulary averages > 3 bytes a word
        text = (text * (_CORPUS_BYTES // max(len(text), 1) + 1))[:_CORPUS_BYTES]
    return text + text


class TextSource:
    """Deterministic filler text per (salt, id): `text(id, tokens)` is always the same string."""

    def __init__(self, salt: str):
        self.salt = salt
        self._corpus = _corpus(salt)
        self._salt_bytes = salt.encode()

    def text(self, ident: str, tokens: int) -> str:
        """`tokens` x 4 bytes of text that starts with a unique header naming `ident`."""
        n = max(int(tokens), 1) * BYTES_PER_TOKEN
        header = f"[{ident}] "
        if len(header) >= n:
            return header[:n]
        digest = hashlib.blake2b(ident.encode(), key=self._salt_bytes[:64], digest_size=8).digest()
        off = int.from_bytes(digest, "little") % _CORPUS_BYTES
        need = n - len(header)
        parts = [header]
        while need > 0:
            take = min(need, _CORPUS_BYTES)
            parts.append(self._corpus[off:off + take])
            need -= take
            off = (off + 7919) % _CORPUS_BYTES
        return "".join(parts)


def text_tokens(s: str) -> int:
    return (len(s) + BYTES_PER_TOKEN - 1) // BYTES_PER_TOKEN

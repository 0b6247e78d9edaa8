"""Session hints: the client's own name for a conversation, read from the request and hashed at once.

Clients that know their conversations say so: OpenAI's `prompt_cache_key` (coding agents set
it to their conversation id), Anthropic's `metadata.user_id` on the Messages route, or a
header an operator names (RJ_SESSION_HEADER, for a gateway's session id). The chain of
block hashes can only guess which requests continue a conversation; a key says it.

Only a keyed hash of the key is kept (BLAKE2b, 64 bits, keyed with a salt the balancer
draws at start): the raw key, which may be a user id, never reaches the router's memory,
the journal, the log or the operator API, and a hash cannot be checked against a guessed
id without the salt. Anything unusable is ignored, never refused: a key that is not a
string, is empty, or is longer than MAX_KEY_BYTES gives no hint (the engine, which gets the
body unchanged, judges its own API). Pure: no I/O.
"""

from __future__ import annotations

import hashlib

MAX_KEY_BYTES = 256  # longer keys are ignored (Anthropic caps metadata.user_id at 256 characters)
PROMPT_CACHE_KEY_ROUTES = frozenset({"chat", "completions", "responses"})  # OpenAI's request bodies


def _usable(raw: bytes) -> bytes | None:
    raw = raw.strip()
    return raw if 0 < len(raw) <= MAX_KEY_BYTES else None


def _text(value: object) -> bytes | None:
    if type(value) is not str or len(value) > MAX_KEY_BYTES:  # characters bound bytes from below: cheap first cut
        return None
    return _usable(value.encode("utf-8", "surrogatepass"))


def session_key(route: str, body: dict, header: bytes | None = None) -> bytes | None:
    """The request's conversation key, tagged with where it came from; None when it carries none that is usable.

    The operator's header comes first (it was named on purpose), then `prompt_cache_key`, then
    Anthropic's `metadata.user_id` (often one per user rather than per conversation: the weakest).
    """
    if header is not None and (key := _usable(header)) is not None:
        return b"h\0" + key
    if route in PROMPT_CACHE_KEY_ROUTES and (key := _text(body.get("prompt_cache_key"))) is not None:
        return b"p\0" + key
    if route == "messages":
        metadata = body.get("metadata")
        if type(metadata) is dict and (key := _text(metadata.get("user_id"))) is not None:
            return b"u\0" + key
    return None


def hashed(key: bytes, salt: bytes = b"") -> int:
    """A 64-bit keyed hash of a session key; never 0, which means "no key" (salt: at most 64 bytes)."""
    value = int.from_bytes(hashlib.blake2b(key, digest_size=8, key=salt).digest(), "big")
    return value or 1


def session_hint(route: str, body: dict, header: bytes | None = None, salt: bytes = b"") -> int:
    """The hashed key of the request's conversation, or 0 when it names none."""
    key = session_key(route, body, header)
    return 0 if key is None else hashed(key, salt)

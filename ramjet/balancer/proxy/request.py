"""A client's request as the proxy reads and reshapes it: the body parsed once, the rank pin, the headers kept.

Pure: no I/O. Errors are ApiError (400) with a message a client can act on. The body is
re-serialised at most once, and only when RJ_MAX_TOKENS_STRIP drops a field; the rank pin
is spliced onto whatever is sent, per attempt, without re-serialising.
"""

from __future__ import annotations

import orjson

from ramjet.errors import bad_request

# Request headers never forwarded upstream: hop-by-hop, the client's credentials and cookies,
# the client's rank pin (newer SGLang lets the header beat the body), and
# accept-encoding (the usage tap reads the raw bytes).
_DROP_REQUEST = frozenset({b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
                           b"upgrade", b"proxy-authorization", b"proxy-connection", b"authorization", b"cookie",
                           b"x-data-parallel-rank", b"accept-encoding", b"x-api-key", b"trailer"})


def parse_object(raw: bytes, max_depth: int) -> dict:
    """The body as a JSON object nested at most `max_depth` levels; a 400 otherwise."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if too_deep(body, max_depth):
        raise bad_request(f"request body is nested deeper than {max_depth} levels", "body")
    return body


def too_deep(obj: object, limit: int) -> bool:
    """Is any container nested more than `limit` levels deep? Only containers are visited."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        for child in (node.values() if type(node) is dict else node):
            if type(child) is dict or type(child) is list:
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


# RJ_MAX_TOKENS_STRIP, as the Rust Ramjet applies it: these fields of these routes, integers at or above it
STRIPPED_FIELDS = ("max_tokens", "max_completion_tokens")
STRIPPED_ROUTES = frozenset({"chat", "completions"})


def strip_max_tokens(route: str, body: dict, raw: bytes, threshold: int) -> bytes:
    """Drop the client's output limits at or above `threshold` (0: off) from `body` (in place) and `raw`.

    For clients that ask for more output than any context holds, which some engines refuse.
    An integer field at or above the threshold goes (floats, strings and nulls stay, as the
    Rust Ramjet leaves them); `raw` comes back untouched unless something was dropped.
    """
    if threshold <= 0 or route not in STRIPPED_ROUTES:
        return raw
    dropped = [k for k in STRIPPED_FIELDS if type(body.get(k)) is int and body[k] >= threshold]
    if not dropped:
        return raw
    for k in dropped:
        del body[k]
    return orjson.dumps(body)


def pin_body(raw: bytes, rank: int) -> bytes:
    """Append "routed_dp_rank": N as the body's last key by splicing bytes (no re-serialisation).

    JSON parsers keep the last of duplicate keys, so a client's own pin loses.
    The caller has already parsed `raw` as a JSON object.
    """
    inner = raw.rstrip()[:-1].rstrip()
    sep = b"" if inner.endswith(b"{") else b","
    return b"%s%s\"routed_dp_rank\":%d}" % (inner, sep, rank)


def pinned(raw: bytes, headers: list[tuple[bytes, bytes]], path: str,
           rank: int | None) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The body and headers that pin a request to DP rank `rank` (None: the engine picks): the body's
    `routed_dp_rank`, and on OpenAI routes the `X-Data-Parallel-Rank` header that newer SGLang reads too."""
    if rank is None:
        return raw, headers
    if path.startswith("/v1/"):
        headers = headers + [(b"x-data-parallel-rank", str(rank).encode())]
    return pin_body(raw, rank), headers


def forwardable(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.lower() not in _DROP_REQUEST]

"""Matching a presented key against the configured ones (RJ_API_KEYS, RJ_ADMIN_KEYS) without a timing leak."""

from __future__ import annotations

import hmac


def matching_key(given: bytes, keys: list[bytes]) -> bytes | None:
    """The configured key equal to `given`, or None. Every key is compared, each in constant time, so the
    time taken tells neither whether nor which one matched."""
    found = None
    for key in keys:
        if hmac.compare_digest(given, key):
            found = key
    return found

"""Which paths the client-facing listener serves, and the paths it refuses before anything else.

Generation routes are routed by prefix; GET passthrough routes (RJ_PASSTHROUGH_ROUTES)
go to any routable replica; everything else is 404. A path that could name something
else once an engine or proxy normalises it is refused outright (docs/security.md).
"""

from __future__ import annotations

import re

GENERATION_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/generate": "generate",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
PROBES = frozenset({"/health", "/readyz", "/livez"})  # never need a key; also on the metrics listener
# Paths that could name something else once an engine or proxy normalises them: dot segments,
# empty segments, backslashes, control characters, ? and # (all decoded: an encoded ? would end the
# path upstream), and encoded slashes, dots, backslashes.
_ODD_PATH = re.compile(r"[\x00-\x1f\x7f\\?#]|//|(^|/)\.\.?(/|$)")
_ODD_RAW = re.compile(rb"%(2[eEfF]|5[cC]|00)")


def odd_path(path: str, raw_path: bytes | None) -> bool:
    """Is this path (decoded, and as sent) anything but a plain path?"""
    return bool(_ODD_PATH.search(path) or _ODD_RAW.search(raw_path or b""))


def route_matcher(templates: list[str]) -> re.Pattern:
    """RJ_PASSTHROUGH_ROUTES (`/v1/models/{id}`: {name} is one path segment) as one anchored pattern."""
    alternatives = [re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", re.escape(t)) for t in templates]
    return re.compile("(?:" + "|".join(alternatives) + ")") if alternatives else re.compile("(?!)")

"""Parsers of the values settings hold (engine URLs, listener addresses, what a secret looks like in a
message), the on/off words every setting shares, and the one error a bad configuration raises."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

# The words pydantic accepts for a boolean (any case), for code that reads such a variable without the model.
TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})


class ConfigError(Exception):
    """Start-up configuration is unusable; the message names every offending variable."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


def redact(text: str) -> str:
    """Hide URL credentials: a URL's user:password part is a secret."""
    return re.sub(r"//[^/@\s]*@", "//***@", text)


def normalise_url(raw: str) -> str:
    """Engine base URL -> canonical form (lower-case scheme and host, no trailing slash).

    One canonical form per engine, because the engine identity (all ranks behind
    one process) is the URL. Credentials, queries and fragments are refused:
    the upstream token goes in RJ_UPSTREAM_TOKEN, never in a URL.
    """
    url = raw.strip().rstrip("/")
    expected = "expected http(s)://host[:port][/path]"
    if not url:
        raise ValueError(f"empty URL; {expected}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"{redact(url)!r} is not a valid URL; {expected}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{redact(url)!r} is not an http(s) URL; {expected}")
    if "@" in parts.netloc:
        raise ValueError(f"{redact(url)!r} carries credentials; put the token in RJ_UPSTREAM_TOKEN")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ValueError(f"{redact(url)!r} has a query or fragment; {expected}")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{redact(url)!r} has port {port} out of range; {expected}")
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path.rstrip('/')}"


def parse_addr(raw: str) -> tuple[str, int]:
    """`host:port` or `[ipv6]:port` -> (host, port), host without brackets as servers want it."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\[\]\s]+):(\d+)", raw.strip())
    if not m:
        raise ValueError(f"{raw!r} is not host:port; expected e.g. 0.0.0.0:8000 or [::]:8000")
    host, port = (m[1], m[2]) if m[1] else (m[3], m[4])
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port {port} is out of range 1-65535")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another host name: it may resolve anywhere

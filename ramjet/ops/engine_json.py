"""Asking an engine for a JSON object, as the operator checks (check-hicache, check-precise) do.

One place says what counts as an answer: a 200 with a JSON object. Anything else is a
CheckError naming the request and what came back, so a check ends with a sentence, not a
traceback.
"""

from __future__ import annotations

import httpx


class CheckError(Exception):
    """Bad input, or the engine cannot be asked at all."""


MISSING = (404, 405)  # the route does not exist on this engine (vLLM's /server_info, SGLang's older names)


async def engine_json(client: httpx.AsyncClient, method: str, url: str, body: dict | None = None,
                      headers: dict | None = None, missing_ok: bool = False) -> dict | None:
    """The JSON object `method url` answers; None when `missing_ok` and the route is missing."""
    try:
        r = await client.request(method, url, json=body, headers=headers)
    except httpx.HTTPError as e:
        raise CheckError(f"{method} {url}: {type(e).__name__}: {e}") from None
    if missing_ok and r.status_code in MISSING:
        return None
    if r.status_code != 200:
        raise CheckError(f"{method} {url} answered {r.status_code}: {r.text[:300]}")
    try:
        data = r.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise CheckError(f"{method} {url} did not answer a JSON object: {r.text[:200]!r}")
    return data

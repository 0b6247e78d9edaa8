"""Small questions to an engine: how it is laid out, how loaded each rank is, and who it is.

One client for every part that asks (topology's `dp_size auto`, precise mode's event
publishers, engine-reported load, the state file's engine check), so each question is
asked one way: the same paths in the same order, each GET bounded by the client's
timeout and read whole through `Upstream.fetch`. What the answers mean is parsed in
engines/report.py, without I/O.
"""

from __future__ import annotations

import asyncio

import orjson

from ramjet.balancer.engines.report import (Identity, RankFigure, aggregate, from_v1_loads, from_vllm_metrics,
                                            launch_from_server_info)
from ramjet.balancer.engines.upstream import Upstream, UpstreamFailure

# SGLang's server description: the older path first (a newer SGLang still serves it), the newer one
# where the older is gone. /get_server_info asks every scheduler: a loaded engine answers slowly.
SERVER_INFO_PATHS = ("/get_server_info", "/server_info")
Figures = dict[int, RankFigure]


class EngineClient:
    def __init__(self, upstream: Upstream, timeout_s: float):
        self.upstream, self.timeout_s = upstream, timeout_s

    async def get(self, url: str) -> tuple[int, bytes]:
        """(status, body); UpstreamFailure when unreachable, too slow or too large."""
        return await self.upstream.fetch("GET", url, self.timeout_s)

    async def server_info(self, engine: str) -> dict:
        """SGLang's server description; UpstreamFailure when unreachable, ValueError (saying why) when the
        engine serves it on neither path as a JSON object (vLLM serves neither)."""
        for path in SERVER_INFO_PATHS:
            status, body = await self.get(engine + path)
            if status in (404, 405) and path != SERVER_INFO_PATHS[-1]:
                continue
            if status != 200:
                raise ValueError(f"GET {path} answered HTTP {status}")
            try:
                info = orjson.loads(body)
            except orjson.JSONDecodeError:
                raise ValueError(f"GET {path} did not answer JSON") from None
            if not isinstance(info, dict):
                raise ValueError(f"GET {path} did not answer a JSON object")
            return info
        raise AssertionError("unreachable")

    async def dp_size(self, engine: str) -> int:
        """The engine's DP size from its server description; ValueError saying why it cannot be read."""
        try:
            info = await self.server_info(engine)
        except UpstreamFailure as e:
            raise ValueError(f"GET {SERVER_INFO_PATHS[0]} failed: {e.reason}") from None
        size = info.get("dp_size")
        if size is None and isinstance(info.get("server_args"), dict):
            size = info["server_args"].get("dp_size")
        if not (type(size) is int and size >= 1):
            raise ValueError(f"its server description has no valid dp_size (got {size!r})")
        return size

    async def v1_loads(self, engine: str) -> Figures:
        """SGLang's `GET /v1/loads`; ValueError when it is not served or not one."""
        status, body = await self.get(engine + "/v1/loads")
        if status != 200:
            raise ValueError(f"/v1/loads answered {status}")
        return from_v1_loads(body)

    async def vllm_metrics(self, engine: str) -> tuple[Figures, str | None]:
        """vLLM's `GET /metrics`: (figure per DP engine, launch value); ValueError when it is not vLLM's."""
        status, body = await self.get(engine + "/metrics")
        if status != 200:
            raise ValueError(f"/metrics answered {status}")
        return from_vllm_metrics(body.decode("utf-8", "replace"))

    async def identify(self, engine: str) -> tuple[Figures, str | None] | None:
        """Per-rank restart counters and the launch value (report.Identity); None if it says neither.

        SGLang's server description asks every scheduler and may be slow on a busy engine; `/v1/loads`
        is read beside it, not after it."""
        info, loads = await asyncio.gather(self.server_info(engine), self.v1_loads(engine), return_exceptions=True)
        launch = launch_from_server_info(info) if isinstance(info, dict) else None
        if isinstance(loads, dict):
            return loads, launch
        try:
            figures, started = await self.vllm_metrics(engine)
        except (UpstreamFailure, ValueError):
            return ({}, launch) if launch else None
        return figures, started or launch


def identity_of(found: tuple[Figures, str | None] | None, rank: int | None) -> Identity | None:
    """One replica's Identity from what `EngineClient.identify` found about its engine."""
    if found is None:
        return None
    figure = aggregate(found[0], rank)
    return Identity(found[1], None if figure is None else figure.prefilled)

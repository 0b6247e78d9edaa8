"""Where each replica's engine publishes its KV events: the operator's endpoints, or the engine's own description."""

from __future__ import annotations

import logging
from dataclasses import replace

from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.engines.client import EngineClient
from ramjet.balancer.engines.upstream import UpstreamFailure
from ramjet.balancer.precise.matcher import Matcher
from ramjet.kvevents.discovery import Endpoints, from_operator, from_server_info

log = logging.getLogger("ramjet.precise")


async def discover(replicas: list[Replica], client: EngineClient, matcher: Matcher, events_endpoint: str | None,
                   replay_endpoint: str | None, topic: str) -> list[Endpoints | None]:
    """Each replica's endpoints (None: it publishes none, or they cannot be read: it is routed approximately).

    `events_endpoint` (RJ_KV_EVENTS_ENDPOINT, with RJ_KV_EVENTS_REPLAY_ENDPOINT and _TOPIC), when set, names them; else SGLang's /server_info does, one request an engine. An SGLang
    engine also tells the matcher how that engine joins a message's text parts."""
    infos: dict[str, dict | None] = {}
    out: list[Endpoints | None] = []
    for i, r in enumerate(replicas):
        rank = r.dp_rank or 0
        if r.engine not in infos:
            infos[r.engine] = await _server_info(client, r.engine)
            if infos[r.engine] is not None:  # an SGLang engine: it joins a message's text parts with spaces
                matcher.join_text_parts_with(" ")
        try:
            if events_endpoint:
                out.append(from_operator(events_endpoint, r.engine, rank, i, replay=replay_endpoint,
                                         topic=topic))
                continue
            found = from_server_info(infos[r.engine], r.engine, rank) if infos[r.engine] else None
            if found is not None and replay_endpoint:
                found = replace(found, replay=from_operator(replay_endpoint, r.engine, rank, i).events)
            out.append(found)
        except ValueError as e:
            log.warning("upstream %s: KV events: %s; it is routed approximately", r.ordinal, e)
            out.append(None)
    return out


async def _server_info(client: EngineClient, engine: str) -> dict | None:
    """The engine's SGLang server description, which names its publishers; None where it has none (vLLM)."""
    try:
        return await client.server_info(engine)
    except (UpstreamFailure, ValueError):
        return None

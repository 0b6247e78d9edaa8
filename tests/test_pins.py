"""What the balancer relies on beyond its dependencies' public APIs is still there, and the image's pins fit.

edge/protocol.py subclasses uvicorn's httptools protocol and server/serve.py its Server,
hooking methods and attributes uvicorn does not promise to keep (pyproject.toml bounds
uvicorn for that reason). If an upgrade moves one, these tests fail naming it, where the
behaviour tests would fail in less obvious ways (a hook never called is no error).
"""

from __future__ import annotations

import asyncio
import re
import tomllib
from pathlib import Path

import pytest
import uvicorn
from packaging.requirements import Requirement
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
MOVED = "uvicorn {} no longer has {}: edge/protocol.py and server/serve.py hook it; re-check them against this uvicorn"


def test_the_protocol_hooks_are_where_the_limited_protocol_expects_them():
    for name in ("_start_asgi_task", "_unset_keepalive_if_required", "connection_made", "connection_lost",
                 "data_received", "on_message_begin", "on_url", "on_header", "on_headers_complete",
                 "on_message_complete"):
        assert callable(getattr(HttpToolsProtocol, name, None)), MOVED.format(uvicorn.__version__, name)
    source = Path(httptools_impl.__file__).read_text()
    assert re.search(r"self\._start_asgi_task\(self\.cycle, app\)", source), \
        MOVED.format(uvicorn.__version__, "the call _start_asgi_task(cycle, app) when a request's headers complete")
    assert "STATUS_LINE" in dir(httptools_impl), MOVED.format(uvicorn.__version__, "STATUS_LINE")
    assert callable(getattr(RequestResponseCycle, "run_asgi", None)), MOVED.format(uvicorn.__version__, "run_asgi")
    for name in ("response_started", "response_complete"):
        assert f"self.{name} =" in source, MOVED.format(uvicorn.__version__, f"RequestResponseCycle.{name}")


async def test_a_new_protocol_has_the_attributes_the_limits_read():
    state = ServerState()
    config = uvicorn.Config(lambda scope, receive, send: None, http="httptools")
    config.load()
    protocol = HttpToolsProtocol(config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop())
    for name in ("connections", "tasks", "parser", "cycle", "loop"):
        assert hasattr(protocol, name), MOVED.format(uvicorn.__version__, f"HttpToolsProtocol.{name}")
    assert protocol.connections is state.connections and protocol.tasks is state.tasks


def test_the_server_keeps_what_the_shutdown_phases_use():
    server = uvicorn.Server(uvicorn.Config(lambda scope, receive, send: None))
    for name in ("server_state", "started", "should_exit"):
        assert hasattr(server, name), MOVED.format(uvicorn.__version__, f"Server.{name}")
    assert callable(getattr(uvicorn.Server, "capture_signals", None)), MOVED.format(uvicorn.__version__,
                                                                                      "Server.capture_signals")
    for name in ("connections", "tasks"):
        assert hasattr(server.server_state, name), MOVED.format(uvicorn.__version__, f"ServerState.{name}")


def test_the_image_pins_every_runtime_dependency_within_its_range():
    """constraints.txt (what the Docker image installs) pins each runtime dependency at a version pyproject allows."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[_canonical(name)] = version.strip()
    for spec in project["dependencies"]:
        req = Requirement(spec)
        pinned = pins.get(_canonical(req.name))
        assert pinned is not None, f"constraints.txt does not pin {req.name} (see its header to regenerate it)"
        assert req.specifier.contains(pinned), f"constraints.txt pins {req.name}=={pinned}, outside {req.specifier}"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

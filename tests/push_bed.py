"""The secured bed both Web Push browser tests run on (tests/test_surface_push*.py).

A real nats-server enforcing per-party credentials, the real gateway as
``service:gateway``, the real notifier as ``service:notifier``, an agent
``planner`` on its own credentials, and alice's page server whose page
connects as ``principal:alice`` over the WebSocket listener.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from consumers.notify.service import Notifier
from consumers.surfaces.feed import browser_auth
from consumers.surfaces.web import WebSurfaceServer
from gateway.app import Gateway
from gateway.security import Party, embedded_auth
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams
from subjects.client import Agent


@asynccontextmanager
async def secured_push_bed(tmp_path: Path, notifier: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """Yield {web, notifier, agent, base, tmp}; ``notifier`` is the [notifier] settings (its link is added)."""
    web = WebSurfaceServer(principal="alice", ws_url="ws://127.0.0.1:1", port=0)  # ws_url set below
    await web.start()
    base = f"http://{web.host}:{web.port}/"
    settings = {"agents": {"planner": {"principals": ["alice"]}},
                "notifier": {"presence_grace_s": 0, "surface_url": base, **notifier}}
    config = load_config(None, data_dir=str(tmp_path / "data"), **settings)
    auth = embedded_auth(config)
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1,
                            authorization=auth.server_block)
    await server.start()
    config = load_config(None, data_dir=str(tmp_path / "data"), nats_url=server.client_url, **settings)

    def creds(role: str, name: str) -> str:
        return str(auth.creds_for(Party(role, name)))  # type: ignore[arg-type]

    conns = []
    try:
        gw_nc = await connect(server.client_url, creds=creds("service", "gateway"), name="gateway")
        n_nc = await connect(server.client_url, creds=creds("service", "notifier"), name="notifier")
        agent_nc = await connect(server.client_url, creds=creds("agent", "planner"), name="planner")
        conns = [gw_nc, n_nc, agent_nc]
        await ensure_streams(gw_nc.jetstream(), config.subjects)
        # The page connects as alice, with her own credentials only.
        web.ws_url = server.websocket_url
        web.auth = browser_auth(server.client_url, creds("principal", "alice"))
        assert web.auth and web.auth["type"] == "nkey"
        async with Gateway(config, gw_nc), Notifier(config, n_nc) as running:
            agent = Agent(agent_nc, "planner")
            try:
                yield {"web": web, "notifier": running, "agent": agent, "base": base, "tmp": tmp_path}
            finally:
                await agent.close()
    finally:
        for c in conns:
            await c.drain()
        await web.drain()
        await server.stop()

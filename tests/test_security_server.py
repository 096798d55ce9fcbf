"""What the embedded server exposes besides the client port (issue 19).

- the monitoring HTTP port is off unless asked for, and loopback-only when on;
- the WebSocket port enforces the same per-party users and permissions as the
  client port, and refuses a browser whose page is not the browser surface's;
- ``pgw.capabilities`` answers the same generic document to everyone: no party
  names, secrets, paths, keys or URLs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
import pytest_asyncio

from gateway.security import Party, embedded_auth
from pgwcli.commands.up import browser_origins
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from subjects.errors import ConfigError
from tests.gauntlet.bed import flushed
from tests.pipeline_helpers import running_gateway

pytestmark = pytest.mark.security
MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

TABLE = "embedded server exposure"
WAIT = 5.0


def test_monitoring_is_off_by_default_and_loopback_when_on(tmp_path: Path, security_table) -> None:
    """The default configuration writes no monitoring listener; asked for, it binds loopback only, and another host is refused."""
    cfg = load_config(None, data_dir=str(tmp_path / "d"))
    assert cfg.server.monitor_port is None
    text = EmbeddedServer(tmp_path / "n", monitor_port=cfg.server.monitor_port).config_text(tmp_path)
    assert "http:" not in text and "http_port" not in text
    on = EmbeddedServer(tmp_path / "n", monitor_port=8222).config_text(tmp_path)
    assert 'http: "127.0.0.1:8222"' in on
    with pytest.raises(ConfigError, match=r"server.host"):
        load_config(None, server={"host": "0.0.0.0"})
    security_table.record(TABLE, "monitoring port", "anyone on the network", "nats-server", "off by default; loopback when on",
                          "off by default; loopback when on", True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ws_bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    """A secured server as `pgw up` starts it (default monitoring, WebSocket with the browser surface's origins)."""
    tmp = tmp_path_factory.mktemp("secws")
    config = load_config(None, data_dir=str(tmp / "data"), agents={"a1": {"principals": ["p1", "p2"]}})
    auth = embedded_auth(config)
    server = EmbeddedServer(tmp / "nats", port=-1, monitor_port=config.server.monitor_port, websocket_port=-1,
                            websocket_origins=browser_origins(config), authorization=auth.server_block)
    await server.start()
    try:
        yield {"config": config, "auth": auth, "server": server}
    finally:
        await server.stop()


@MODULE_LOOP
async def test_monitoring_listener_is_absent_when_not_asked(ws_bed: dict[str, Any], security_table) -> None:
    """A server started with the default configuration reports no monitoring URL in its ports file."""
    assert ws_bed["server"].monitor_url == ""
    assert ws_bed["server"].websocket_url.startswith("ws://127.0.0.1:")
    security_table.record(TABLE, "monitoring port at default", "local user", "nats-server", "not listening", "not listening", True)


async def _ws_conn(bed: dict[str, Any], party: Party) -> tuple[nats.NATS, asyncio.Queue[str]]:
    errors: asyncio.Queue[str] = asyncio.Queue()

    async def on_error(e: Exception) -> None:
        errors.put_nowait(str(e))

    nc = await connect(bed["server"].websocket_url, creds=str(bed["auth"].creds_for(party)), name=f"ws-{party.name}",
                       error_cb=on_error, allow_reconnect=False, max_reconnect_attempts=0)
    return nc, errors


@MODULE_LOOP
async def test_websocket_enforces_the_same_permissions(ws_bed: dict[str, Any], security_table) -> None:
    """Over WebSocket, principal p2 is refused p1's surface by the server (0 delivered) while its own works; no credentials, no connection."""
    s = ws_bed["config"].subjects
    svc = await connect(ws_bed["server"].client_url, creds=str(ws_bed["auth"].service_creds), name="svc")
    p2, errors = await _ws_conn(ws_bed, Party("principal", "p2"))
    try:
        stolen = await p2.subscribe(s.surface("p1"))
        own = await p2.subscribe(s.surface("p2"))
        await flushed(p2)
        err = ""
        while "permissions violation" not in err.lower():
            err = await asyncio.wait_for(errors.get(), WAIT)
        assert s.surface("p1").lower() in err.lower()
        await svc.publish(s.surface("p1"), b'{"for": "p1"}')
        await svc.publish(s.surface("p2"), b'{"for": "p2"}')
        await flushed(svc)
        assert (await own.next_msg(timeout=WAIT)).data == b'{"for": "p2"}'
        await flushed(p2)
        assert stolen.pending_msgs == 0
        await p2.publish(s.resolve("p1"), b"{}")
        err = ""
        while "permissions violation" not in err.lower():
            err = await asyncio.wait_for(errors.get(), WAIT)
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await nats.connect(ws_bed["server"].websocket_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    finally:
        await p2.close()
        await svc.close()
    security_table.record(TABLE, "WebSocket: another principal's surface / resolve", "principal:p2 (ws)", "principal:p1",
                          "refused, 0 delivered", "refused, 0 delivered", True)


async def _handshake(url: str, origin: str | None) -> int:
    headers = {"Origin": origin} if origin else {}
    async with aiohttp.ClientSession() as http:
        try:
            # ClientWSTimeout from aiohttp 3.11; before it (pyproject admits 3.9.1) a float is the close timeout
            timeout = aiohttp.ClientWSTimeout(ws_close=WAIT) if hasattr(aiohttp, "ClientWSTimeout") else WAIT
            ws = await http.ws_connect(url, headers=headers, timeout=timeout)
        except aiohttp.WSServerHandshakeError as e:
            return e.status
        await ws.close()
        return 101


@MODULE_LOOP
async def test_websocket_checks_the_browser_origin(ws_bed: dict[str, Any], security_table) -> None:
    """A browser page from another origin cannot open the WebSocket (403); the browser surface's own page and native clients can."""
    url = ws_bed["server"].websocket_url
    surface_page = f"http://127.0.0.1:{ws_bed['config'].surfaces.web_port}"
    assert await _handshake(url, "http://evil.example") == 403
    assert await _handshake(url, f"http://127.0.0.1:{ws_bed['config'].surfaces.web_port + 1}") == 403
    assert await _handshake(url, surface_page) == 101
    assert await _handshake(url, None) == 101  # no Origin header: a native client (nats-server checks browsers only)
    security_table.record(TABLE, "WebSocket origin check", "page at http://evil.example", "ws listener",
                          "refused (403)", "refused (403)", True)


def test_browser_origins_follow_the_surface_config(tmp_path: Path) -> None:
    """The allowed origins are the browser surface's host and port; a random web port allows no browser at all."""
    cfg = load_config(None, data_dir=str(tmp_path), surfaces={"web_port": 9001})
    assert set(browser_origins(cfg)) == {"http://127.0.0.1:9001", "http://localhost:9001"}
    none = load_config(None, data_dir=str(tmp_path), surfaces={"web_port": 0})
    assert all(o.endswith(".invalid") for o in browser_origins(none))
    text = EmbeddedServer(tmp_path, websocket_port=-1, websocket_origins=browser_origins(cfg)).config_text(tmp_path)
    assert 'allowed_origins: ["http://127.0.0.1:9001", "http://localhost:9001"]' in text


async def test_capabilities_reveal_nothing_party_specific(nats_server, tmp_path: Path, nc, security_table) -> None:
    """The capability document names no agent, principal, secret, path, key or server URL, whoever asks."""
    secret = "sk-live-CAPS-9931-never"
    async with running_gateway(nats_server, str(tmp_path / "d"), agents={"hidden-agent": {"principals": ["hidden-principal"]}},
                               pipeline={"secrets": {"values": [secret]}}) as gw:
        reply = await nc.request(gw.subjects.capabilities, b"{}", timeout=WAIT)
    doc = json.loads(reply.data)
    assert "supportedEnvelopes" in doc
    text = reply.data.decode()
    for needle in ("hidden-agent", "hidden-principal", secret, str(tmp_path), nats_server.client_url, "127.0.0.1", "creds",
                   "nkey", "_INBOX"):
        assert needle not in text, needle
    security_table.record(TABLE, "pgw.capabilities content", "any party", "gateway", "generic document only",
                          "generic document only", True)

"""Settings of the installable app (issue 17, docs/surfaces.md "Installing the app").

The page token is kept across runs of ``pgw surface-web`` (0600) and renewed
on request. Behind a TLS proxy: the documented settings load; the proxy's
https origin is then allowed on the embedded nats-server's WebSocket listener
(a browser page from that origin gets through, another origin still gets
403); a public_url that is not https:// is refused with the field named.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import aiohttp
import pytest

from consumers.surfaces.web import stored_token
from pgwcli.commands.up import browser_origins
from pgwcore.config import load_config
from pgwcore.server import EmbeddedServer
from subjects.errors import ConfigError

DOCS = Path(__file__).resolve().parent.parent / "docs" / "surfaces.md"


def documented() -> dict:
    text = DOCS.read_text()
    block = re.search(r"### Serving over HTTPS.*?```toml\n(.*?)```", text, re.S)
    assert block, "docs/surfaces.md lost its 'Serving over HTTPS' settings"
    return tomllib.loads(block.group(1))


async def handshake(url: str, origin: str) -> int:
    async with aiohttp.ClientSession() as http:
        try:
            ws = await http.ws_connect(url, headers={"Origin": origin})
        except aiohttp.WSServerHandshakeError as e:
            return e.status
        await ws.close()
        return 101


async def test_the_proxy_origin_is_allowed_on_the_websocket_listener(tmp_path: Path) -> None:
    config = load_config(None, data_dir=str(tmp_path), **documented())
    assert config.surfaces.ws_url.startswith("wss://")
    origins = browser_origins(config)
    assert "https://gw.example.org" in origins and "http://127.0.0.1:8765" in origins
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1, websocket_origins=origins)
    await server.start()
    try:
        assert await handshake(server.websocket_url, "https://gw.example.org") == 101
        assert await handshake(server.websocket_url, "http://127.0.0.1:8765") == 101
        assert await handshake(server.websocket_url, "https://evil.example.org") == 403
    finally:
        await server.stop()


@pytest.mark.parametrize("bad", ["http://gw.example.org", "https://gw.example.org/app", "https://", "gw.example.org"])
def test_public_url_must_be_an_https_origin(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ConfigError, match=r"surfaces\.public_url"):
        load_config(None, data_dir=str(tmp_path), surfaces={"public_url": bad})


def test_the_page_token_is_kept_private_and_renewed_on_request(tmp_path: Path) -> None:
    path = tmp_path / "surface-web" / "alice.token"
    first = stored_token(path)
    assert len(first) >= 32 and path.stat().st_mode & 0o777 == 0o600
    assert stored_token(path) == first, "an installed app keeps working after a restart"
    renewed = stored_token(path, renew=True)
    assert renewed != first and stored_token(path) == renewed
    path.write_text("short\n")
    assert stored_token(path) not in ("short", renewed), "a damaged file is replaced, never used"

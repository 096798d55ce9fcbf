"""Both surfaces with the principal's own credentials, on a server that enforces them (DESIGN §7).

The server runs the authorization block ``pgw creds`` generates; the gateway,
the agent and alice each connect as themselves. The terminal surface (JSON
mode, over TCP) and the browser surface (nkey over the WebSocket listener,
with alice's own inbox prefix) must work with alice's credentials alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.app import Gateway
from gateway.security import embedded_auth
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.identity import Party
from pgwcore.server import EmbeddedServer
from subjects.client import Agent
from subjects.wire import EnvelopeOutcome, OptionChoice, ResolutionOutcome

sys.path.insert(0, str(Path(__file__).parent / "web"))
from surface_kit import CHROMIUM, CHROMIUM_ARGS, REPO, browser_ready, moment

WAIT = 20.0


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """A server enforcing per-party nkeys, the gateway connected as its service user, and the agent as itself."""
    config = load_config(
        None,
        data_dir=str(tmp_path / "data"),
        agents={"planner": {"principals": ["alice"]}},
        security={"principals": ["bob"]},
    )
    auth = embedded_auth(config)
    server = EmbeddedServer(
        tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1, authorization=auth.server_block
    )
    os.environ["PGW_HEALTH_CREDS"] = ""  # health check: "authorization" refusals count as up
    await server.start()
    config = load_config(None, data_dir=str(tmp_path / "data"), nats_url=server.client_url,
                         agents={"planner": {"principals": ["alice"]}}, security={"principals": ["bob"]})
    gw_nc = await connect(server.client_url, creds=str(auth.service_creds), name="gateway")
    agent_nc = await connect(server.client_url, creds=str(auth.creds_for(Party("agent", "planner"))), name="agent")
    try:
        async with Gateway(config, gw_nc) as gw:
            agent = Agent(agent_nc, "planner")
            yield {"server": server, "auth": auth, "agent": agent, "gateway": gw, "tmp": tmp_path}
            await agent.close()
    finally:
        await agent_nc.drain()
        await gw_nc.drain()
        await server.stop()
        os.environ.pop("PGW_HEALTH_CREDS", None)


async def send(agent: Agent) -> str:
    eid = await agent.send_moment("alice", moment())
    out = await agent.outcome_for(eid, timeout=WAIT)
    assert out.status == "accepted" and out.moment_id, out
    return out.moment_id


async def final(agent: Agent, mid: str) -> Any:
    async def first() -> Any:
        async for o in agent.outcomes():
            if not isinstance(o, EnvelopeOutcome) and getattr(o, "moment_id", None) == mid:
                return o
        raise AssertionError("unreachable")

    return await asyncio.wait_for(first(), WAIT)


async def test_terminal_surface_with_alice_creds_reads_and_answers(secured: dict[str, Any]) -> None:
    """`pgw surface --creds alice.creds --json` lists alice's moment and its answer reaches the agent."""
    mid = await send(secured["agent"])
    creds = secured["auth"].creds_for(Party("principal", "alice"))
    env = dict(os.environ, PGW_DATA_DIR=str(secured["tmp"] / "other"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pgwcli", "--server", secured["server"].client_url, "--creds", str(creds),
        "surface", "--principal", "alice", "--json", cwd=str(REPO), env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    answer = json.dumps({"moment_id": mid, "resolution": {"kind": "option", "index": 1}}).encode()
    out, err = await asyncio.wait_for(proc.communicate(answer + b"\n"), WAIT)
    events = [json.loads(line) for line in out.decode().splitlines()]
    assert proc.returncode == 0, (events, err.decode()[-2000:])
    assert [e["item"]["moment_id"] for e in events if e["event"] == "item" and e["item"]["item"] == "binding_moment"] == [mid]
    assert [e["reply"]["status"] for e in events if e["event"] == "reply"] == ["accepted"]
    res = await final(secured["agent"], mid)
    assert isinstance(res, ResolutionOutcome) and res.resolution == OptionChoice(index=1)


async def test_terminal_surface_with_bobs_creds_cannot_read_alice(secured: dict[str, Any]) -> None:
    """With bob's credentials, `pgw surface --principal alice` fails at once, naming whose file it is (the server's own
    refusal of alice's subjects to bob is tests/test_security_matrix.py's)."""
    await send(secured["agent"])
    creds = secured["auth"].creds_for(Party("principal", "bob"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pgwcli", "--server", secured["server"].client_url, "--creds", str(creds),
        "surface", "--principal", "alice", "--json", cwd=str(REPO),
        env=dict(os.environ, PGW_DATA_DIR=str(secured["tmp"] / "other")),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), WAIT * 2)
    events = [json.loads(line) for line in out.decode().splitlines()]
    assert not [e for e in events if e["event"] == "item"], events
    # `pgw` refuses another party's file before it connects (docs/operations.md "Credentials"), in one line.
    assert "principal:bob" in err.decode() and "alice" in err.decode() and "Traceback" not in err.decode(), err
    assert proc.returncode != 0


async def test_browser_surface_connects_over_websocket_with_alice_nkey(secured: dict[str, Any]) -> None:
    """The page authenticates with alice's nkey and inbox prefix over the WebSocket listener, shows the moment and answers it."""
    reason = browser_ready()
    if reason:
        pytest.skip(reason)
    from playwright.async_api import async_playwright

    from consumers.surfaces.feed import browser_auth
    from consumers.surfaces.web import WebSurfaceServer

    creds = secured["auth"].creds_for(Party("principal", "alice"))
    auth = browser_auth(secured["server"].client_url, str(creds))
    assert auth and auth["type"] == "nkey" and auth["inbox_prefix"] == "_INBOX_principal_alice"
    mid = await send(secured["agent"])
    web_server = WebSurfaceServer(principal="alice", ws_url=secured["server"].websocket_url, auth=auth, port=0)
    async with web_server as web, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(web.url)
            card = page.locator(f"article[data-moment-id='{mid}']")
            await card.wait_for(timeout=WAIT * 1000)
            await card.locator("label.option", has_text="Hold until the board meets").click()
            await card.get_by_role("button", name="Answer: Hold until the board meets").click()
            await card.locator(".reply-ok", has_text="Accepted").wait_for(timeout=WAIT * 1000)
        finally:
            await browser.close()
    res = await final(secured["agent"], mid)
    assert isinstance(res, ResolutionOutcome) and res.resolution == OptionChoice(index=2)

"""`pgw mcp` on a server that enforces isolation (DESIGN §7): it speaks the bus with the agent's own credentials
(the file `pgw creds` wrote), and everything it needs is within them: envelopes, the outcome durable, the moment query."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.app import Gateway
from gateway.security import Party, embedded_auth
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from subjects.wire import OptionChoice
from tests.test_integration_mcp import AGENT, MOMENT, PRINCIPAL, Env, moment_answer, read_then_kill9

pytestmark = pytest.mark.security


@pytest.fixture
async def isolated(tmp_path: Path) -> AsyncIterator[Env]:
    """A server running the generated authorization block; the gateway on the services' creds; alice on hers."""
    data = tmp_path / "data"
    probe = load_config(None, data_dir=str(data), agents={AGENT: {"principals": [PRINCIPAL]}})
    auth = embedded_auth(probe)
    assert auth.creds_for(Party("agent", AGENT)).exists()  # what `pgw mcp --data-dir` will find and use
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1, authorization=auth.server_block)
    await server.start()
    ncs: list[Any] = []
    try:
        config = load_config(None, data_dir=str(data), nats_url=server.client_url, agents={AGENT: {"principals": [PRINCIPAL]}})
        service = await connect(server.client_url, creds=str(auth.service_creds), name="gateway")
        alice = await connect(server.client_url, creds=str(auth.creds_for(Party("principal", PRINCIPAL))), name="alice")
        ncs += [service, alice]
        async with Gateway(config, service):
            env = Env.__new__(Env)
            env.url, env.data_dir, env.nc, env.js = server.client_url, data, alice, service.jetstream()
            yield env
    finally:
        for nc in ncs:
            await nc.drain()
        await server.stop()


async def test_pgw_mcp_with_isolation_on_asks_and_resumes_with_the_agents_own_credentials(isolated: Env, tmp_path: Path) -> None:
    """Under the generated permissions, `pgw mcp` (the agent's creds from the data dir) asks alice and gets her answer;
    killed (-9) after reading a later answer, the restarted server returns it through the moment query, which the
    agent's permissions allow (and only for its own moments), as they allow its list of moments."""
    env = isolated
    answering = env.principal_answers(moment_answer(OptionChoice(index=0)))
    async with env.stdio() as session:
        result = await asyncio.wait_for(session.call_tool("ask_principal", {"principal": "alice", "binding_moment": MOMENT}), 30)
    assert (await answering).status == "accepted"
    assert {k: result.structuredContent[k] for k in ("status", "kind", "index")} == {"status": "resolved", "kind": "option", "index": 0}

    moment_id = await read_then_kill9(env, "stdio", tmp_path, OptionChoice(index=1))
    async with env.stdio() as session:
        again = await asyncio.wait_for(session.call_tool("await_moment", {"moment_id": moment_id}), 20)
        listed = await asyncio.wait_for(session.call_tool("list_moments", {"which": "all"}), 20)
    assert again.structuredContent == {"status": "resolved", "kind": "option", "index": 1, "moment_id": moment_id}
    # The list form of the same query, within the same permissions: its two moments, newest first.
    moments = listed.structuredContent["moments"]
    assert [m["status"] for m in moments] == ["resolved", "resolved"] and moments[0]["moment_id"] == moment_id, listed

"""The notifier under server-enforced isolation (DESIGN §7, issue 17).

The server runs the authorization block `pgw creds` generates. The notifier
connects as ``service:notifier`` (its own identity, not the services union),
alice's surface as ``principal:alice`` and the agent as ``agent:planner``: the
push subscription, the presence and the notification all go through, so the
notifier's permissions are enough and the principal's four subjects are hers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from consumers.notify.service import Notifier
from gateway.app import Gateway
from gateway.security import Party, embedded_auth
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams
from subjects.client import Agent, Presence
from tests.moments import good_moment
from tests.notify_peers import webhook_receiver
from tests.polling import until

pytestmark = pytest.mark.security


async def test_notifier_works_with_its_own_identity(tmp_path: Path) -> None:
    async with webhook_receiver(tmp_path) as hook:
        config = load_config(
            None, data_dir=str(tmp_path / "data"), agents={"planner": {"principals": ["alice"]}},
            notifier={"presence_grace_s": 0, "principals": {"alice": {
                "webhook_url": hook.url, "webhook_secret_file": str(hook.secret_file)}}},
        )
        auth = embedded_auth(config)
        server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1,
                                authorization=auth.server_block)
        await server.start()
        conns = []
        try:
            def creds(role: str, name: str) -> str:
                return str(auth.creds_for(Party(role, name)))  # type: ignore[arg-type]

            gw_nc = await connect(server.client_url, creds=creds("service", "gateway"), name="gateway")
            n_nc = await connect(server.client_url, creds=creds("service", "notifier"), name="notifier")
            alice = await connect(server.client_url, creds=creds("principal", "alice"), name="alice")
            agent_nc = await connect(server.client_url, creds=creds("agent", "planner"), name="planner")
            conns = [gw_nc, n_nc, alice, agent_nc]
            await ensure_streams(gw_nc.jetstream(), config.subjects)
            async with Gateway(config, gw_nc), Notifier(config, n_nc) as notifier:
                s = config.subjects
                key = json.loads((await alice.request(s.push("alice", "key"), b"{}", timeout=5)).data)
                assert key["ok"] and key["vapid_public_key"] == notifier.vapid.public_b64url
                agent = Agent(agent_nc, "planner")
                await agent.send_moment("alice", good_moment(), expires_in_s=600)

                async def one() -> bool:
                    return len(hook.accepted) == 1

                await until(one, timeout=15, what="the webhook, sent by service:notifier")
                assert hook.accepted[0]["principal"] == "alice"

                async with Presence(alice, "alice", surface="web", ttl_s=30):
                    async def heard() -> bool:
                        return notifier.presence.present("alice")

                    await until(heard, timeout=5, what="alice's presence, published with her own credentials")
                await agent.close()
        finally:
            for c in conns:
                await c.drain()
            await server.stop()

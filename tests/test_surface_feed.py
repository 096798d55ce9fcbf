"""The surface feed across a lost connection (consumers/surfaces/feed.py).

The surface reaches the real nats-server through a small TCP relay the test
can cut, so only the surface goes offline while the gateway and other
devices carry on; after nats-py reconnects, the feed must catch up from the
pending snapshot.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from consumers.surfaces.feed import ConnectionWatch, SurfaceFeed, connect_principal
from consumers.surfaces.model import DecisionPlan, WithdrawPlan, plan_item
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from subjects.client import Agent
from subjects.wire import OptionChoice

sys.path.insert(0, str(Path(__file__).parent / "web"))
from surface_kit import Relay, moment, planner_agent, running_gateway

WAIT = 20.0


@pytest.fixture
async def agent(nats_server: EmbeddedServer, tmp_path: Path) -> AsyncIterator[Agent]:
    async with running_gateway(nats_server, tmp_path / "gw"), planner_agent(nats_server) as a:
        yield a


async def test_feed_catches_up_after_reconnect(nats_server: EmbeddedServer, agent: Agent) -> None:
    """A moment answered while the surface was offline is withdrawn, and one sent meanwhile is shown, once it reconnects."""
    host, port = nats_server.client_url.removeprefix("nats://").split(":")
    relay = await Relay(host, int(port)).start()
    watch = ConnectionWatch()
    nc = await connect_principal(f"nats://127.0.0.1:{relay.port}", watch=watch, name="laptop")
    other = await connect(nats_server.client_url, name="phone")
    reconnected = asyncio.Event()
    watch.on_reconnect.append(reconnected.set)
    try:
        answered = await agent.send_moment("alice", moment(stem="Answered while offline?"))
        answered_id = (await agent.outcome_for(answered, timeout=WAIT)).moment_id
        feed = SurfaceFeed(nc, "alice", watch=watch)
        items = feed.items()
        first = plan_item(await asyncio.wait_for(anext(items), WAIT))
        assert isinstance(first, DecisionPlan) and first.moment_id == answered_id

        relay.cut()
        assert (await SurfaceFeed(other, "alice").resolve(answered_id, OptionChoice(index=0))).status == "accepted"
        later = await agent.send_moment("alice", moment(stem="Sent while offline?"))
        later_id = (await agent.outcome_for(later, timeout=WAIT)).moment_id
        relay.open = True
        await asyncio.wait_for(reconnected.wait(), WAIT)

        seen: dict[str, Any] = {}
        while len(seen) < 2:
            plan = plan_item(await asyncio.wait_for(anext(items), WAIT))
            seen[type(plan).__name__] = plan
        gone, new = seen["WithdrawPlan"], seen["DecisionPlan"]
        assert isinstance(gone, WithdrawPlan) and gone.moment_id == answered_id and gone.reason == "resolved"
        assert isinstance(new, DecisionPlan) and new.moment_id == later_id and new.stem == "Sent while offline?"
        await items.aclose()
    finally:
        await other.drain()
        await nc.close()
        await relay.close()

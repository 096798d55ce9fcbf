"""Agent.close() ends the outcome pump even when its cancellation is swallowed (Python 3.11's asyncio.wait_for
turns a cancel that lands as the fetch's own timeout fires into TimeoutError)."""

from __future__ import annotations

import asyncio

from subjects.client import Agent


class _SwallowingSub:
    """Fault injection the real server cannot do: a fetch that answers a cancel with TimeoutError, as
    nats-py's fetch does when the cancel and its wait_for timeout meet (the race seen as a hung close())."""

    def __init__(self) -> None:
        self.fetching = asyncio.Event()
        self.arrived = asyncio.Event()  # no message ever arrives: each fetch ends at its timeout

    async def fetch(self, batch: int, timeout: float) -> list:
        self.fetching.set()
        try:
            await asyncio.wait_for(self.arrived.wait(), timeout)
        except asyncio.CancelledError:
            raise TimeoutError from None
        raise TimeoutError

    async def unsubscribe(self) -> None:
        return None


async def test_close_ends_the_pump_when_its_cancel_is_swallowed(nc) -> None:
    """With a fetch that swallows the cancel, close() still returns (within a few fetch timeouts)."""
    agent = Agent(nc, "closer")
    agent._sub = sub = _SwallowingSub()
    agent._pump = asyncio.create_task(agent._run_pump())
    await sub.fetching.wait()  # the pump is inside its fetch
    await asyncio.wait_for(agent.close(), 5)
    assert agent._pump is None

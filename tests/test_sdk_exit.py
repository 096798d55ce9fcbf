"""An agent program that ends without closing its ``Agent`` ends (subjects.client)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any


async def test_a_program_that_ends_without_closing_its_agent_ends(nats_server: Any) -> None:
    """A program that closes its connection and returns without closing its agent: the agent's outcome pump took
    each fetch's "connection closed" for a reconnect and tried again every 0.2 s, so the loop's end waited for it
    for ever and the program never ended (found while testing: a test that did not close its agent hung at its
    loop's close). The pump now ends with its connection. (It also ends on a cancel that Python 3.11's wait_for
    turned into the fetch's timeout; that race is rare and not forced here.)"""
    script = f"""
import asyncio
from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.streams import ensure_streams
from subjects.client import Agent

async def main():
    nc = await connect({nats_server.client_url!r}, name="sdk-exit")
    await ensure_streams(nc.jetstream(), Config().subjects)
    agent = Agent(nc, "planner")
    try:
        await agent.outcome_for("never-sent", timeout=1.5)
    except TimeoutError:
        pass
    await nc.close()  # as a test's fixture does, before the loop's end cancels what is left

asyncio.run(main())
print("ended")
"""
    for _ in range(3):  # the lost cancel is a race: three programs, each must end
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError("the program did not end within 30 s of main() returning") from None
        assert proc.returncode == 0 and out.strip() == b"ended", (out, err)

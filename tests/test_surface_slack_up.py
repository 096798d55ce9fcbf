"""`pgw up` runs the Slack surface when `[slack] enabled`: with isolation on (the default) it answers as slack:alice."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import aiohttp
import pytest

from pgwcore.connect import connect
from subjects.client import Agent
from subjects.wire import OptionChoice
from tests.moments import good_moment
from tests.ports import free_port
from tests.slack_standin import (
    BOT_TOKEN,
    SIGNING_SECRET,
    button_press,
    signed_interaction,
    slack_standin,
)
from tests.test_up import PGW

USER = "U0ALICE"


@pytest.mark.slow
async def test_pgw_up_runs_the_slack_surface_under_its_own_identity(tmp_path) -> None:
    """`pgw up` with [slack] enabled starts the Slack surface (listed in the banner, its own slack-alice
    credentials); a moment from the demo agent is posted to alice's DM and a press in Slack answers it."""
    port = free_port()
    async with slack_standin() as slack, aiohttp.ClientSession() as http:
        cfg = tmp_path / "pgw.toml"
        cfg.write_text(
            "[server]\nport = -1\nmonitor_port = -1\nwebsocket_port = -1\n"
            f'[slack]\nenabled = true\napi_url = "{slack.url}"\nhttp_port = {port}\n'
            f'[slack.principals.alice]\nuser = "{USER}"\n')
        data = tmp_path / "data"
        env = {**os.environ, "PGW_LOG_LEVEL": "WARNING", "PGW_SLACK_BOT_TOKEN": BOT_TOKEN,
               "PGW_SLACK_SIGNING_SECRET": SIGNING_SECRET}
        proc = await asyncio.create_subprocess_exec(
            PGW, "--config", str(cfg), "--data-dir", str(data), "--log-format", "json", "up", "--open",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env)
        try:
            out = ""
            while not re.search(r"services\s+[^\n]*surface-slack", out):
                line = await asyncio.wait_for(proc.stdout.readline(), 60)
                assert line, f"pgw up ended early:\n{out}"
                out += line.decode(errors="replace")
            url = re.search(r"NATS\s+(nats://127\.0\.0\.1:\d+)", out).group(1)
            assert (data / "creds" / "slack-alice.creds").exists(), "the Slack surface has its own identity"
            nc = await connect(url, creds=str(data / "creds" / "agent-demo-agent.creds"), name="agent")
            agent = Agent(nc, "demo-agent")
            try:
                eid = await agent.send_moment("alice", good_moment())
                mid = (await agent.outcome_for(eid, timeout=20)).moment_id
                [msg] = await slack.wait(lambda: slack.of(mid), timeout=30)
                body, headers = signed_interaction(button_press(msg, "pgw_option_1", USER))
                async with http.post(f"http://127.0.0.1:{port}/slack/interactions", data=body, headers=headers) as r:
                    assert r.status == 200
                assert (await agent.resolution_for(mid, timeout=20)).resolution == OptionChoice(index=1)
            finally:
                await agent.close()
                await nc.close()
            proc.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGINT)
                try:
                    await asyncio.wait_for(proc.wait(), 30)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()

"""kill -9 of ``pgw surface-slack`` mid-burst, then a restart (docs/surfaces.md "Slack: delivery").

The real ``pgw surface-slack`` runs as a child process against a real
nats-server and gateway and the loopback Slack stand-in, whose
``chat.postMessage`` answers slowly so posts are in flight at the kill. A
burst of moments is sent, a few are answered in Slack, the process is
SIGKILLed part-way and started again.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.app import Gateway
from pgwcore.connect import connect
from subjects.client import Agent
from subjects.wire import OptionChoice
from tests.chaos.harness import ServiceProc
from tests.moments import good_moment
from tests.polling import until
from tests.ports import free_port, held_port
from tests.slack_standin import (
    BOT_TOKEN,
    SIGNING_SECRET,
    button_press,
    signed_interaction,
    slack_standin,
)
from tests.test_notify_kill9 import toml

pytestmark = [pytest.mark.slow, pytest.mark.chaos]
MOMENTS = 24
USER = "U0ALICE"


async def start_listening(proc: ServiceProc, listen: Callable[[int], None], port: int | None = None,
                          tries: int = 3) -> int:
    """Start ``pgw surface-slack`` (``proc``) with its interactions port written into its config by ``listen``
    (``port``, else one from ``free_port``) and wait until it says it listens; the port it listens on. When it
    dies because another process bound the port between the choice and its bind ("address already in use"),
    it is started again on a new port."""
    for _ in range(tries):
        port = port or free_port()
        listen(port)
        await proc.start()
        said = f"interactions on http://127.0.0.1:{port}/"
        await until(lambda said=said: _ready(said in _log(proc) or not proc.alive), timeout=60, interval=0.05,
                    what=lambda said=said: f"pgw surface-slack saying {said!r}\n{proc.log_tail()}")
        if said in _log(proc):
            return port
        if "address already in use" not in _log(proc).lower():
            raise AssertionError(f"pgw surface-slack did not start:\n{proc.log_tail()}")
        port = None
    raise AssertionError(f"pgw surface-slack: no free port after {tries} tries")


def _log(proc: ServiceProc) -> str:
    return proc.log.read_text(errors="replace") if proc.log is not None and proc.log.exists() else ""


def secret_file(path: Path, value: str) -> str:
    path.write_text(value)
    path.chmod(0o600)
    return str(path)


def slack_config(cfg_file: Path, tmp_path: Path, api_url: str) -> Callable[[int], None]:
    """The function ``start_listening`` calls to write the surface's configuration for a port."""

    def listen(port: int) -> None:
        cfg_file.write_text(toml({"slack": {
            "enabled": True, "api_url": api_url, "http_port": port,
            "bot_token_file": secret_file(tmp_path / "bot", BOT_TOKEN),
            "signing_secret_file": secret_file(tmp_path / "signing", SIGNING_SECRET),
            "principals": {"alice": {"user": USER}}}}))

    return listen


async def test_kill9_mid_burst_every_moment_posted_once_every_answer_once(tmp_path, make_config, nats_server, nc) -> None:
    """Killed mid-burst and restarted, the Slack surface posts every moment exactly once (a post whose record was
    lost is found in the channel's history, not posted again), every answer given in Slack reaches the agent exactly
    once, and every answered moment's message ends without buttons."""
    async with slack_standin() as slack, aiohttp.ClientSession() as http:
        slack.hold_posts_after = 4  # the fifth post stays in flight until the kill
        cfg_file = tmp_path / "slack.toml"
        listen = slack_config(cfg_file, tmp_path, slack.url)

        proc = ServiceProc("surface-slack", nats_server.client_url, tmp_path / "slack-data", cfg_file)
        gw_nc = await connect(nats_server.client_url, name="gateway")
        agent = Agent(nc, "planner")
        port = 0  # where the surface listens (start_listening)

        async def press(mid: str, seen: Any = None) -> int:
            [msg] = [seen] if seen is not None else slack.of(mid)
            body, headers = signed_interaction(button_press(msg, "pgw_option_1", USER))
            async with http.post(f"http://127.0.0.1:{port}/slack/interactions", data=body, headers=headers) as r:
                return r.status

        try:
            async with Gateway(make_config(), gw_nc):
                port = await start_listening(proc, listen)
                mids = []
                for _ in range(MOMENTS):
                    eid = await agent.send_moment("alice", good_moment(), expires_in_s=3600)
                    mids.append((await agent.outcome_for(eid, timeout=10)).moment_id)
                await until(lambda: _ready(len(slack.posted()) >= 4 and slack.count("chat.postMessage") > 4),
                            timeout=60, interval=0.02, what=lambda: f"the first posts, and one held\n{proc.log_tail()}")
                early = [m for m in mids if slack.of(m)][:3]
                assert [await press(m) for m in early] == [200, 200, 200]
                proc.kill9()
                await proc.wait_dead()
                slack.released.set()  # the held post lands in the channel; the surface that sent it is gone
                posted_at_kill = len(slack.posted())
                assert posted_at_kill < MOMENTS, "the burst was over before the kill; nothing was tested"

                port = await start_listening(proc, listen, port)  # the same port, unless it was taken meanwhile
                await until(lambda: _ready(all(slack.of(m) for m in mids)), timeout=90, interval=0.1,
                            what=lambda: f"every moment posted after the restart\n{proc.log_tail()}")
                later = [m for m in mids if m not in early]
                for m in later:
                    [shown] = [copy.deepcopy(x) for x in slack.of(m)]  # the stand-in edits in place
                    assert await press(m) == 200
                    # Pressed twice on the message as it was shown (a double click before Slack
                    # redraws it): the gateway takes the first only.
                    assert await press(m, shown) == 200
                resolutions = {m: await agent.resolution_for(m, timeout=20) for m in mids}

                def all_closed() -> bool:
                    return all(not any(b.get("accessory") or b["type"] == "actions" for b in slack.of(m)[0].blocks)
                               for m in mids)

                await until(lambda: _ready(all_closed()), timeout=60, interval=0.1,
                            what=lambda: f"every answered moment closed on Slack\n{proc.log_tail()}")
        finally:
            await proc.stop()
            await agent.close()
            await gw_nc.drain()

        posts = Counter(a["metadata"]["event_payload"]["id"] for m, a in slack.calls if m == "chat.postMessage")
        assert sorted(posts) == sorted(mids) and set(posts.values()) == {1}, posts
        assert all(r.resolution == OptionChoice(index=1) for r in resolutions.values())
        # Exactly one resolution per moment on the agent's stream.
        js = nc.jetstream()
        sub = await js.subscribe("pgw.agent.planner.outcome", ordered_consumer=True)
        seen: Counter[str] = Counter()
        while True:
            try:
                msg = await sub.next_msg(timeout=1)
            except Exception:  # noqa: BLE001 - the stream is read to its end
                break
            out = json.loads(msg.data)
            if out.get("outcome") == "resolution":
                seen[out["moment_id"]] += 1
        assert set(seen) == set(mids) and set(seen.values()) == {1}, seen
        print(f"\nkill -9 after {posted_at_kill}/{MOMENTS} posts; {len(early)} answered before it")


async def _ready(value: bool) -> bool:
    return value


async def test_the_slack_surface_starts_on_a_new_port_when_its_port_was_taken(tmp_path, nats_server, nc) -> None:
    """When another process listens on the interactions port chosen for ``pgw surface-slack`` before the
    surface binds it, the surface's start fails with "address already in use" and the test starts it again
    on a new port, where it answers, instead of waiting out its timeout."""
    async with slack_standin() as slack, aiohttp.ClientSession() as http:
        cfg_file = tmp_path / "slack.toml"
        listen = slack_config(cfg_file, tmp_path, slack.url)

        proc = ServiceProc("surface-slack", nats_server.client_url, tmp_path / "slack-data", cfg_file)
        try:
            with held_port() as taken:
                port = await start_listening(proc, listen, taken)
            assert port != taken and proc.starts == 2
            assert "address already in use" in (tmp_path / "slack-data" / "surface-slack-1.log").read_text().lower()
            async with http.post(f"http://127.0.0.1:{port}/slack/interactions", data=b"") as r:
                assert r.status == 401  # the surface answers there (an unsigned request is refused)
        finally:
            await proc.stop()

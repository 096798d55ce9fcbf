"""Connecting: a refused credential is a clear error at start, never an endless retry loop."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from pgwcore.connect import ConnectError, close_quietly, connect
from pgwcore.server import EmbeddedServer
from tests.polling import until


@pytest.fixture
async def locked_server(tmp_path: Path):
    server = EmbeddedServer(
        tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=None,
        authorization='authorization { user: "ops", password: "s3cret-pass" }',
    )
    await server.start()
    yield server
    await server.stop()


async def test_one_shot_and_service_connects_fail_fast_on_refused_credentials(locked_server):
    """Both a one-shot command and a service get ConnectError naming the credentials, within seconds."""
    for once in (True, False):
        with pytest.raises(ConnectError) as e:
            await asyncio.wait_for(connect(locked_server.client_url, once=once), 10)
        assert e.value.auth and "--creds" in str(e.value)


async def test_closing_with_the_server_gone_leaves_no_reconnect_loop(tmp_path: Path):
    """close_quietly ends nats-py's reconnect loop even when Python 3.11 loses close()'s cancellation.

    The loss happens when the cancel lands as a connect attempt is refused; with attempts every
    millisecond, a good part of 60 connections hit it (before the fix: the loop went on for ever,
    and a service told to stop with its server gone never exited, CI stop 36).
    """
    server = await EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=None, websocket_port=None).start()
    async def quiet(e: Exception) -> None:
        """No log line per refused attempt (thousands)."""

    conns = [await connect(server.client_url, reconnect_time_wait=0.001, error_cb=quiet) for _ in range(60)]
    server.kill()

    async def reconnecting() -> bool:
        return all(nc.is_reconnecting for nc in conns)

    def left() -> list[asyncio.Task]:
        return [t for nc in conns if (t := nc._reconnection_task) is not None and not t.done()]

    try:
        await until(reconnecting, timeout=10, interval=0.01, what="every connection reconnecting")
        await asyncio.gather(*(close_quietly(nc, timeout=1) for nc in conns))
        assert all(nc.is_closed for nc in conns)
        assert not left(), f"{len(left())} of {len(conns)} reconnect loops outlived close_quietly"
    finally:  # a failed run must not leave loops that hang the test's event loop at its end
        for _ in range(200):
            if not (pending := left()):
                break
            for t in pending:
                t.cancel()
            await asyncio.wait(pending, timeout=0.05)


async def test_one_shot_connect_fails_fast_when_no_server():
    """A one-shot command against a closed port fails at once with the URL named."""
    with pytest.raises(ConnectError) as e:
        await asyncio.wait_for(connect("nats://127.0.0.1:1", once=True, connect_timeout=2), 10)
    assert "nats://127.0.0.1:1" in str(e.value) and not e.value.auth


def test_streams_command_says_what_to_do(locked_server):
    """`pgw streams` without credentials exits 1 with the hint, instead of hanging."""
    pgw = str(Path(sys.executable).parent / "pgw")
    out = subprocess.run([pgw, "streams", "--server", locked_server.client_url], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 1
    assert "requires credentials" in out.stderr

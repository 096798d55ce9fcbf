"""Connecting: a refused credential is a clear error at start, never an endless retry loop."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from pgwcore.connect import ConnectError, connect
from pgwcore.server import EmbeddedServer


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

"""The start-up durability check (pgwcore/durability.py) against real nats-servers with and without sync always."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from pgwcore.connect import connect
from pgwcore.durability import DurabilityError, check_durability
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams
from subjects.names import Subjects

STREAMS = ["PGW_VERDICTS", "PGW_OUTBOUND"]


async def _server(tmp: Path, sync: str | None) -> EmbeddedServer:
    return await EmbeddedServer(tmp, port=-1, monitor_port=-1, websocket_port=None, sync_interval=sync).start()


async def test_r1_streams_on_a_server_without_sync_always_are_refused(tmp_path: Path) -> None:
    """R1 streams on nats-server's default sync: `refuse` stops start-up naming them; `warn` logs one line."""
    server = await _server(tmp_path / "default", None)
    nc = await connect(server.client_url, name="t", once=True)
    try:
        js = nc.jetstream()
        await ensure_streams(js, Subjects("pgw"))
        with pytest.raises(DurabilityError, match=r"PGW_VERDICTS .*R1 without sync_interval: always"):
            await check_durability(js, STREAMS, monitor_url=server.monitor_url, policy="refuse")
        with capture_logs() as logs:
            found = await check_durability(js, STREAMS, monitor_url=server.monitor_url, policy="warn")
        assert [f.durable for f in found] == [False, False]
        assert [e["event"] for e in logs] == ["streams are not crash-durable on this server"]
        # Without a monitoring URL the setting is unknown, which `refuse` does not take on trust.
        with pytest.raises(DurabilityError, match="sync setting unknown"):
            await check_durability(js, STREAMS, policy="refuse")
    finally:
        await nc.close()
        await server.stop()


async def test_r1_streams_with_sync_always_pass(tmp_path: Path) -> None:
    """The embedded default (sync_interval: always) passes `refuse` with nothing logged."""
    server = await _server(tmp_path / "always", "always")
    nc = await connect(server.client_url, name="t", once=True)
    try:
        js = nc.jetstream()
        await ensure_streams(js, Subjects("pgw"))
        with capture_logs() as logs:
            found = await check_durability(js, STREAMS, monitor_url=server.monitor_url, policy="refuse")
        assert [(f.stream, f.sync_always, f.durable) for f in found] == [(s, True, True) for s in STREAMS]
        assert logs == []
    finally:
        await nc.close()
        await server.stop()

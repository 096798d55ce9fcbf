"""A secured test bed: nats-server with the generated authorization block, a
gateway connected as the service user, and one connection per party.

Used by the security tests that need the real gateway (DESIGN §7 bindings and
the hostile-input gauntlet). Every party connects with its own credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from gateway.app import Gateway
from gateway.security import EmbeddedAuth, Party, embedded_auth
from pgwcore.config import Config, load_config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from subjects.client import Agent, Surface
from subjects.wire import Verdict, verdict_decoder

AGENTS = {"a": ["p", "q"], "b": ["q"]}


async def flushed(nc: Any) -> None:
    """Round trip that covers everything buffered so far.

    nats-py 2.16 ``flush()`` writes its PING straight to the socket, ahead of
    commands still in the client's buffer (a SUB, a PUB), so the PONG can come
    back before the server has seen them. Wait for the buffer to be written first.
    """
    written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    await nc._flush_queue.put(written)  # private: no public way to await the flusher
    await asyncio.wait_for(written, 10)  # the flusher has written the buffer (FIFO queue)
    await nc.flush()
PRINCIPALS = ["p", "q"]


@dataclass
class Bed:
    config: Config
    server: EmbeddedServer
    auth: EmbeddedAuth
    gw: Gateway | None = None
    gw_nc: Any = None
    ncs: dict[str, Any] = field(default_factory=dict)
    agents: dict[str, Agent] = field(default_factory=dict)
    surfaces: dict[str, Surface] = field(default_factory=dict)
    verdicts: list[Verdict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _verdict_waiters: list[tuple[Any, asyncio.Future[Verdict]]] = field(default_factory=list)

    async def start_gateway(self) -> Gateway:
        self.gw_nc = await connect(self.server.client_url, creds=str(self.auth.service_creds), name="gateway")
        self.gw = Gateway(self.config, self.gw_nc)
        await self.gw.__aenter__()
        return self.gw

    async def stop_gateway(self) -> None:
        if self.gw is not None:
            await self.gw.__aexit__(None, None, None)
            self.gw = None
        if self.gw_nc is not None:
            await self.gw_nc.drain()
            self.gw_nc = None

    def verdict(self, pred: Any, timeout: float = 15.0) -> Any:
        """Wait for a verdict matching ``pred`` (already seen or still to come)."""
        fut: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        for v in self.verdicts:
            if pred(v):
                fut.set_result(v)
                break
        else:
            self._verdict_waiters.append((pred, fut))
        return asyncio.wait_for(fut, timeout)

    def _on_verdict(self, v: Verdict) -> None:
        self.verdicts.append(v)
        for pred, fut in self._verdict_waiters:
            if not fut.done() and pred(v):
                fut.set_result(v)


async def _watch_verdicts(bed: Bed, nc: Any) -> Any:
    async def on_msg(msg: Any) -> None:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            bed._on_verdict(verdict_decoder.decode(msg.data))

    sub = await nc.subscribe(bed.config.subjects.all_verdicts, cb=on_msg)
    await flushed(nc)
    return sub


@contextlib.asynccontextmanager
async def secured_bed(tmp: Path, *, server_kw: dict[str, Any] | None = None, **config_overrides: Any) -> AsyncIterator[Bed]:
    """Start everything; yield the bed; stop everything (the gateway first)."""
    overrides: dict[str, Any] = {
        "data_dir": str(tmp / "data"),
        "agents": {a: {"principals": ps} for a, ps in AGENTS.items()},
    }
    overrides.update(config_overrides)
    config = load_config(None, **overrides)
    auth = embedded_auth(config)
    server = EmbeddedServer(tmp / "nats", port=-1, monitor_port=-1, websocket_port=-1,
                            authorization=auth.server_block, **(server_kw or {}))
    await server.start()
    config = msgspec.structs.replace(config, nats_url=server.client_url)
    bed = Bed(config, server, auth)

    async def on_error(e: Exception) -> None:
        bed.errors.append(str(e))

    try:
        await bed.start_gateway()
        # An ops user would do; the service user sees verdict.* too.
        watcher = await connect(server.client_url, creds=str(auth.service_creds), name="verdict-watch")
        bed.ncs["_watch"] = watcher
        await _watch_verdicts(bed, watcher)
        for a in AGENTS:
            nc = await connect(server.client_url, creds=str(auth.creds_for(Party("agent", a))), name=f"agent-{a}",
                               error_cb=on_error)
            bed.ncs[f"agent:{a}"] = nc
            bed.agents[a] = Agent(nc, a, prefix=config.prefix)
        for p in PRINCIPALS:
            nc = await connect(server.client_url, creds=str(auth.creds_for(Party("principal", p))),
                               name=f"principal-{p}", error_cb=on_error)
            bed.ncs[f"principal:{p}"] = nc
            bed.surfaces[p] = Surface(nc, p, prefix=config.prefix, timeout=15.0)
        yield bed
    finally:
        for ag in bed.agents.values():
            with contextlib.suppress(Exception):
                await ag.close()
        await bed.stop_gateway()
        for nc in bed.ncs.values():
            with contextlib.suppress(Exception):
                await nc.drain()
        await server.stop()

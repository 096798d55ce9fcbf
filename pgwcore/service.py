"""The life cycle every long-lived part shares (STYLE.md "Lifecycles").

A service is an async context manager: entering starts it, ``drain()`` stops
taking new work and finishes in-flight work (idempotent), exiting releases
everything. ``run_services`` wires several with an AsyncExitStack, waits for
a stop event, drains them in reverse order and logs-and-continues past a
drain step that fails.

The platform names no service: the list ``pgw up`` runs (``UP_SERVICES``, name ->
factory ``(config, nc) -> Service``) is the command line's, in ``cli/commands/up.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from pgwcore.logs import get_logger

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from pgwcore.config import Config

log = get_logger("pgw.service")


def delivery(msg: Msg) -> tuple[int, int]:
    """(stream sequence, times delivered) of a JetStream message. The usual reply subject,
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>``,
    is read here at a fifth of the cost of nats' full ``metadata`` (which builds a
    datetime per message); any other form (domains, ADR-15's v2) goes through ``metadata``."""
    t = (msg.reply or "").split(".")
    if len(t) == 9 and t[0] == "$JS" and t[1] == "ACK":
        return int(t[5]), int(t[4])
    meta = msg.metadata
    return meta.sequence.stream, meta.num_delivered


class Service(Protocol):
    name: str

    async def __aenter__(self) -> Any: ...
    async def __aexit__(self, *exc: object) -> None: ...
    async def drain(self) -> None: ...


ServiceFactory = Callable[["Config", "Client"], Service]

def freeze_startup_heap() -> None:
    """Collect once, then move everything alive after start-up (modules, compiled patterns,
    Cedar policies, clients) out of the cyclic collector's reach (``gc.freeze``).

    Issue 18: the gateway holds about 63,000 tracked objects after start-up; every collection
    of the oldest generation re-scanned all of them with the event loop stopped (a pause that
    lands on every envelope in flight, i.e. on p99). What is created afterwards is collected
    as before."""
    gc.collect()
    gc.freeze()


async def run_services(services: list[Service], stop: asyncio.Event, *, on_started: Callable[[], None] | None = None) -> None:
    """Start ``services`` in order, wait for ``stop``, drain in reverse, close."""
    async with contextlib.AsyncExitStack() as stack:
        for svc in services:
            await stack.enter_async_context(svc)
            log.info("service started", service=svc.name)
        freeze_startup_heap()
        if on_started:
            on_started()
        await stop.wait()
        for svc in reversed(services):
            try:
                await svc.drain()
                log.info("service drained", service=svc.name)
            except Exception:
                log.exception("drain failed; continuing", service=svc.name)


async def stop_pull_loop(stopping: asyncio.Event, task: asyncio.Task[Any] | None, sub: Any) -> None:
    """Stop a consumer loop: signal it, let it finish what it holds, release its subscription."""
    stopping.set()
    if task is not None:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if sub is not None:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()

"""Registration with the NATS services API (``nats.micro``) - issue 8 "Ops".

Each service (gateway, signer, registrar) registers under its name, so that
``nats micro ls`` / ``nats micro info pgw-gateway`` find every running instance
through ``$SRV.PING``, ``$SRV.INFO`` and ``$SRV.STATS``. The STATS reply carries
the service's own counters in ``data`` (read from ``pgwcore.metrics``), so an
operator without Prometheus still sees what each instance has done.

Usage, inside a service's ``__aenter__``::

    self._micro = await MicroRegistration(nc, "gateway", config.prefix).start()
    ...
    await self._micro.drain()    # idempotent
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client
from nats.micro import Request
from nats.micro.service import EndpointStats, Service, ServiceConfig

from pgwcore import metrics
from pgwcore.logs import get_logger
from pgwcore.respond import (
    GuardedService,
    Responder,
    release_requests_connection,
    requests_connection,
)

log = get_logger("pgw.micro")

VERSION = "0.1.0"


def service_name(role: str) -> str:
    """``pgw-gateway``, ``pgw-signer``, ``pgw-registrar``: the kind ``nats micro ls`` lists."""
    return f"pgw-{role}"


def no_responders(msg: Any) -> bool:
    """Whether ``msg`` is the server's "no responders" status (``503``, no body), which it sends to a
    request's reply inbox when nobody subscribes to the request's subject: no answer of anyone's. Counted
    as one, a scatter-gather of ``$SRV.PING`` found an instance where none was running."""
    return not msg.data and bool(msg.headers) and msg.headers.get("Status") == "503"


async def count_instances(nc: Client, name: str, timeout: float = 0.5, *, enough: int | None = None) -> int:
    """How many instances of the service ``name`` (``pgw-gateway``: ``service_name``) answer ``$SRV.PING.name``
    within ``timeout``; as soon as ``enough`` have answered, when given (the window is only for those that never
    will). The server's "no responders" status is no instance (``no_responders``)."""
    inbox = nc.new_inbox()
    got = 0
    all_in = asyncio.Event()

    async def cb(msg: Any) -> None:
        nonlocal got
        if no_responders(msg):
            return
        got += 1
        if enough is not None and got >= enough:
            all_in.set()

    sub = await nc.subscribe(inbox, cb=cb)
    try:
        await nc.publish(f"$SRV.PING.{name}", b"", reply=inbox)
        await nc.flush()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_in.wait(), timeout)  # the replies of the window, or enough of them
    finally:
        await sub.unsubscribe()
    return got


def _counters() -> dict[str, float]:
    """Totals of the counters in ``pgwcore.metrics`` (summed over labels), for STATS ``data``."""
    out: dict[str, float] = {}
    for family in metrics.REGISTRY.collect():
        if family.type != "counter":
            continue
        total = sum(s.value for s in family.samples if s.name.endswith("_total"))
        out[family.name] = total
    return out


class MicroRegistration:
    """One ``nats.micro`` service instance; an async context manager with idempotent ``drain()``.

    ``stats`` (optional) returns extra JSON-able data merged into the STATS
    ``data`` member of every endpoint.
    """

    def __init__(
        self,
        nc: Client,
        role: str,
        prefix: str = "pgw",
        *,
        description: str | None = None,
        metadata: dict[str, str] | None = None,
        stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.nc = nc
        self.role = role
        self.prefix = prefix
        self._extra_stats = stats
        self._service: Service | None = None
        self.responder = Responder(prefix, role)  # docs/security.md "Replies"
        self._conn: Client | None = None  # the answering connection (pgwcore/respond.py), while registered
        self._config = ServiceConfig(
            name=service_name(role),
            version=VERSION,
            description=description or f"Principal Gateway {role}",
            metadata={"prefix": prefix, **(metadata or {})},
            stats_handler=self._stats,
        )

    @property
    def id(self) -> str | None:
        return self._service.id if self._service else None

    def _stats(self, endpoint: EndpointStats) -> dict[str, Any]:
        data: dict[str, Any] = {"counters": _counters()}
        if self._extra_stats is not None:
            try:
                data.update(self._extra_stats())
            except Exception:
                log.exception("stats callback failed", service=self.role)
        return data

    async def start(self) -> MicroRegistration:
        if self._service is None:
            self._conn = await requests_connection(self.nc)
            self._service = GuardedService(self._conn, self._config, self.responder)
            await self._service.start()
            # A status endpoint gives `nats micro info` something to show and
            # `nats req pgw.ops.<role>.status ''` a liveness probe per role.
            await self._service.add_endpoint(
                name="status",
                subject=f"{self.prefix}.ops.{self.role}.status",
                handler=self._status,
                queue_group=f"pgw-{self.role}-status",
            )
            log.info("registered with the NATS services API", service=self._config.name, id=self.id)
        return self

    async def _status(self, req: Request) -> None:
        if self.responder.admits(req._msg):
            body = {"service": self._config.name, "id": self.id, "counters": _counters()}
            await self.responder.answer(req._msg, json.dumps(body).encode())

    async def drain(self) -> None:
        service, self._service = self._service, None
        conn, self._conn = self._conn, None
        if service is not None and conn is not None and not conn.is_closed:
            await service.stop()
        await release_requests_connection(self.nc, conn)

    async def __aenter__(self) -> MicroRegistration:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()


async def register(nc: Client, role: str, config: Any, *,
                   stats: Callable[[], dict[str, Any]] | None = None) -> MicroRegistration | None:
    """One-line registration for a service's ``__aenter__`` (honours ``ops.micro``); ``stats``: the
    service's own data in STATS (the signer's ``signing_kid``)."""
    ops = getattr(config, "ops", None)
    if ops is not None and not ops.micro:
        return None
    try:
        return await MicroRegistration(nc, role, config.prefix, stats=stats).start()
    except Exception:
        log.exception("services API registration failed; continuing without it", service=role)
        return None


async def unregister(reg: MicroRegistration | None) -> None:
    """The matching one-liner for ``drain()``; idempotent, never raises."""
    if reg is not None:
        try:
            await reg.drain()
        except Exception:
            log.exception("services API deregistration failed", service=reg.role)

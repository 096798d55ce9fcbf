"""Is what a service writes durable on this server? Checked once at start.

The delivery guarantees of the bus contract (docs/contract.md) assume that a
PubAck means the record survives a crash of the server: either the stream is
replicated (R3: a quorum holds it) or the server fsyncs every write
(``jetstream { sync_interval: always }``, what ``pgw up``'s embedded server
runs). A shared cluster may have neither. nats-server's default syncs every
two minutes, so an R1 stream can lose the last two minutes of acknowledged
records when the machine dies.

The check reads each stream's replica count (stream info) and, for an R1
stream, the server's JetStream configuration from the monitoring endpoint's
``/varz`` (``jetstream.config.sync_always``) when ``ops.nats_monitor_url``
is configured. ``ops.durability`` says what follows: ``warn`` (default: one
log line naming the streams), ``refuse`` (the service stops at start with a
``DurabilityError``), ``off``. When the sync setting cannot be read, an R1
stream is reported as "unknown", which ``refuse`` treats as not durable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import aiohttp
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from pgwcore.logs import get_logger
from subjects.errors import PgwError

log = get_logger("pgw.durability")

Policy = Literal["warn", "refuse", "off"]


class DurabilityError(PgwError):
    """A stream this service writes would lose acknowledged records if the server crashed."""

    def __init__(self, findings: list[StreamDurability]) -> None:
        self.findings = findings
        names = ", ".join(f"{f.stream} ({f.why})" for f in findings)
        super().__init__(
            f"not durable: {names}. Use R3 streams (`pgw streams --replicas 3`) or run nats-server with "
            "`jetstream {{ sync_interval: always }}`, or set ops.durability = \"warn\" to start anyway"
        )


@dataclass(frozen=True)
class StreamDurability:
    stream: str
    replicas: int
    sync_always: bool | None  # None: could not be read

    @property
    def durable(self) -> bool:
        return self.replicas >= 3 or self.sync_always is True

    @property
    def why(self) -> str:
        if self.sync_always is None:
            return f"R{self.replicas}, server sync setting unknown (set ops.nats_monitor_url)"
        return f"R{self.replicas} without sync_interval: always"


async def server_sync_always(monitor_url: str | None, *, timeout: float = 3.0) -> bool | None:
    """``jetstream.config.sync_always`` from the server's ``/varz``; None when it cannot be read."""
    if not monitor_url:
        return None
    url = monitor_url.rstrip("/") + "/varz"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s, s.get(url) as r:
            varz = json.loads(await r.text())
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        log.warning("cannot read the server's JetStream configuration", url=url, error=f"{type(e).__name__}: {e}"[:200])
        return None
    config = (varz.get("jetstream") or {}).get("config") or {}
    return bool(config.get("sync_always", False))


async def check_durability(
    js: JetStreamContext, streams: list[str], *, monitor_url: str | None = None, policy: Policy = "warn",
    service: str = "pgw",
) -> list[StreamDurability]:
    """Check the streams ``service`` writes; log or raise per ``policy``; return what was found."""
    if policy == "off":
        return []
    sync: bool | None = None
    sync_read = False
    found: list[StreamDurability] = []
    for name in streams:
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            continue  # not created yet: the service's own ensure step reports that
        replicas = info.config.num_replicas or 1
        if replicas < 3 and not sync_read:
            sync, sync_read = await server_sync_always(monitor_url), True
        found.append(StreamDurability(name, replicas, sync if replicas < 3 else None))
    weak = [f for f in found if not f.durable]
    if weak and policy == "refuse":
        raise DurabilityError(weak)
    if weak:
        log.warning("streams are not crash-durable on this server", service=service,
                    streams={f.stream: f.why for f in weak})
    return found

"""The gateway's metrics part: counts what the pipeline does, registers with ``nats.micro``, serves /metrics.

The counters themselves live in the platform (``pgwcore.metrics``), shared by
every process; this part is the gateway's wiring of them (its outcome and
timing hooks), kept apart so that the platform's metrics and services-API
modules do not import each other (issue 18).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from gateway.deadletter import DURABLE
from pgwcore import health
from pgwcore.metrics import (
    LATENCY,
    REPLAYS,
    acquire_server,
    child,
    count_envelope,
    count_moment,
    refresh_all_lag,
    safe_label,
)
from pgwcore.micro import MicroRegistration


class MetricsPart:
    """Counts what the gateway does, registers it with ``nats.micro``, serves /metrics.

    Constructed as ``MetricsPart(gateway)``; an async context manager with an
    idempotent ``drain()``.
    """

    name = "metrics"

    def __init__(self, gw: object) -> None:
        self.gw = gw
        self._micro: object | None = None
        self._release: Callable[[], None] | None = None
        self._stop = asyncio.Event()
        self._lag_task: asyncio.Task[None] | None = None
        self._health = health.Registered()

    async def __aenter__(self) -> MetricsPart:
        gw: object = self.gw
        ops = gw.config.ops  # type: ignore[attr-defined]
        gw.outcome_hooks.append(self._on_outcome)  # type: ignore[attr-defined]
        gw.timing_hooks.append(self._on_timing)  # type: ignore[attr-defined]
        if ops.metrics_port is not None:
            self._release = acquire_server(ops.metrics_addr, ops.metrics_port)
            js = gw.js  # type: ignore[attr-defined]
            self._health.add("gateway:connected", health.connected(gw.nc))  # type: ignore[attr-defined]
            self._health.add("gateway:consumer", health.consumer_progress(
                lambda: js.consumer_info("PGW_INBOUND", DURABLE), ops.stall_after_s))
        self._lag_task = asyncio.create_task(self._lag_loop(ops.lag_interval_s), name="metrics-lag")
        return self

    async def ready(self) -> None:
        """Register with ``nats.micro``: called by the gateway once it takes work (every part started,
        its consumer open). An instance ``$SRV.PING`` finds is one that serves: a gateway registered as
        it began to start was counted by an operator (and a test) while it could still fail to start,
        as when a node of its cluster went down meanwhile."""
        if self.gw.config.ops.micro and self._micro is None:  # type: ignore[attr-defined]
            self._micro = await MicroRegistration(self.gw.nc, "gateway", self.gw.subjects.prefix).start()  # type: ignore[attr-defined]

    async def leaving(self) -> None:
        """Deregister first when the gateway drains: no longer found, then no longer serving."""
        micro, self._micro = self._micro, None
        if micro is not None:
            await micro.drain()  # type: ignore[attr-defined]

    async def _lag_loop(self, interval: float) -> None:
        while not self._stop.is_set():
            await refresh_all_lag(self.gw.js)  # type: ignore[attr-defined]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)

    async def _on_outcome(self, ctx: object, outcome: object) -> None:
        tag = type(outcome).__struct_config__.tag  # type: ignore[attr-defined]
        if tag != "envelope_outcome":
            return
        status = getattr(outcome, "status", None)
        if getattr(outcome, "replayed", False):
            REPLAYS.labels(agent=safe_label(getattr(ctx, "agent", ""))).inc()
            return
        count_envelope(str(status), getattr(outcome, "code", None))
        kind = getattr(ctx, "kind", None)
        payload = getattr(ctx, "payload", None)
        if (status == "accepted" and getattr(kind, "handler", None) == "binding_moment"
                and not getattr(outcome, "replayed", False)):
            count_moment(getattr(ctx, "agent", ""), getattr(payload, "binding_moment", None))

    @staticmethod
    def _on_timing(stage: str, seconds: float) -> None:
        child(LATENCY, safe_label(stage)).observe(seconds)

    async def drain(self) -> None:
        self._stop.set()
        task, self._lag_task = self._lag_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        micro, self._micro = self._micro, None
        if micro is not None:
            await micro.drain()  # type: ignore[attr-defined]
        self._health.remove()
        release, self._release = self._release, None
        if release is not None:
            release()
        for hooks, fn in ((getattr(self.gw, "outcome_hooks", []), self._on_outcome),
                          (getattr(self.gw, "timing_hooks", []), self._on_timing)):
            with contextlib.suppress(ValueError):
                hooks.remove(fn)

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()


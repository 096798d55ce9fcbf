"""Readiness of a service, served as ``/healthz`` beside ``/metrics`` (``ops.metrics_port``).

Every long-lived part registers the checks that say it can do its work:

- ``connected``: its NATS connection is up (not reconnecting, not closed);
- ``stream:NAME``: JetStream answers for a stream it reads or writes;
- ``consumer:STREAM/DURABLE``: its durable consumer is not stalled: work is
  pending and the ack floor has not moved for ``ops.stall_after_s``.

``/healthz`` runs every check of the process (each bounded by a timeout, on
the event loop that registered it) and answers ``200 {"status": "ok", ...}``
or ``503 {"status": "unhealthy", "checks": {name: reason}}``: what a
Kubernetes readiness probe or a load balancer expects. A process with no
check registered yet (still starting) is not ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

Check = Callable[[], Awaitable[str | None]]  # None: healthy; else the reason, one line


class Health:
    """The process's checks, run from the HTTP server's thread on their own event loops."""

    def __init__(self) -> None:
        self._checks: dict[str, tuple[asyncio.AbstractEventLoop, Check]] = {}

    def add(self, name: str, check: Check) -> Callable[[], None]:
        """Register ``check`` under ``name`` (on the running loop); returns its removal."""
        self._checks[name] = (asyncio.get_running_loop(), check)

        def remove() -> None:
            self._checks.pop(name, None)

        return remove

    def names(self) -> list[str]:
        return sorted(self._checks)

    def run(self, timeout: float = 2.0) -> tuple[bool, dict[str, str]]:
        """Every check's result (``"ok"`` or its reason); call from a thread other than the loops'."""
        results: dict[str, str] = {}
        for name, (loop, check) in list(self._checks.items()):
            if loop.is_closed():
                results[name] = "its event loop is closed"
                continue
            fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(check(), timeout), loop)
            try:
                reason = fut.result(timeout + 0.5)
            except TimeoutError:
                fut.cancel()
                reason = f"no answer within {timeout:g} s"
            except Exception as e:  # noqa: BLE001 - a check that fails is an unhealthy check
                reason = f"{type(e).__name__}: {e}"[:200]
            results[name] = reason or "ok"
        if not results:
            return False, {"starting": "no service has registered its checks yet"}
        return all(r == "ok" for r in results.values()), results


HEALTH = Health()


def connected(nc: Client) -> Check:
    async def check() -> str | None:
        if nc.is_closed:
            return "the NATS connection is closed"
        if not nc.is_connected:
            return "reconnecting to NATS"
        return None

    return check


def stream_reachable(js: JetStreamContext, stream: str) -> Check:
    async def check() -> str | None:
        await js.stream_info(stream)
        return None

    return check


def consumer_progress(
    info: Callable[[], Awaitable[Any]], stall_after_s: float, *, clock: Callable[[], float] = time.monotonic,
) -> Check:
    """Unhealthy when work waits (pending or unacknowledged) and the ack floor stood still for ``stall_after_s``.

    ``info`` returns the consumer's ``ConsumerInfo`` (``js.consumer_info`` or a pull
    subscription's ``consumer_info``).
    """
    last: dict[str, float] = {}

    async def check() -> str | None:
        ci = await info()
        floor = float(getattr(ci.ack_floor, "stream_seq", 0) or 0)
        waiting = (ci.num_pending or 0) + (ci.num_ack_pending or 0)
        now = clock()
        if last.get("floor") != floor or not waiting:
            last["floor"], last["since"] = floor, now
            return None
        stalled = now - last["since"]
        if stalled >= stall_after_s:
            return f"stalled: {waiting} message(s) waiting, nothing acknowledged for {stalled:.0f} s"
        return None

    return check


class Registered:
    """Checks one part registered, removed together (idempotent)."""

    def __init__(self) -> None:
        self._removals: list[Callable[[], None]] = []

    def add(self, name: str, check: Check) -> None:
        self._removals.append(HEALTH.add(name, check))

    def remove(self) -> None:
        for r in self._removals:
            with contextlib.suppress(Exception):
                r()
        self._removals.clear()

"""Waiting on server-side state that no event announces.

Prefer waiting on the event itself (a future, a subscription, a hook). Some
facts live only on the server: how many messages a stream holds, whether a
durable consumer has drained, whether a cluster has elected a leader. For
those, poll with a bound: this is the one place that does it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def until(
    probe: Callable[[], Awaitable[T]],
    *,
    timeout: float,
    interval: float = 0.05,
    what: str | Callable[[], str] = "condition",
) -> T:
    """Call ``probe()`` until it returns something truthy; return that. TimeoutError after ``timeout``.

    A probe that times out (a request the server answered late: on a loaded machine a stream's info took
    over nats-py's 5 s, and a chaos test failed on the probe, not on what it waited for) counts as not yet,
    within the same bound; the last such timeout is the cause of the TimeoutError, whatever the probes
    said after it. Any other error of the probe is raised at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    late: TimeoutError | None = None
    while True:
        try:
            value = await probe()
        except TimeoutError as e:  # nats.errors.TimeoutError is one too
            value, late = None, e
        if value:
            return value
        if loop.time() > deadline:
            desc = what() if callable(what) else what
            raise TimeoutError(f"{desc} not reached within {timeout} s"
                               + (f" (a probe's request timed out, the last time: {late!r})" if late else "")) from late
        await asyncio.sleep(interval)


async def consumer_drained(js: Any, stream: str, durable: str) -> bool:
    """True once ``durable`` on ``stream`` has nothing pending and nothing unacknowledged."""
    info = await js.consumer_info(stream, durable)
    return (info.num_pending or 0) + (info.num_ack_pending or 0) == 0


async def until_drained(js: Any, stream: str, durable: str, *, timeout: float, interval: float = 0.05,
                        what: str | None = None) -> None:
    """Wait until ``durable`` on ``stream`` has taken and acked everything stored (:func:`consumer_drained`)."""
    await until(lambda: consumer_drained(js, stream, durable), timeout=timeout, interval=interval,
                what=what or f"{durable} on {stream} drained")

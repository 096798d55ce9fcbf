"""Reading back what a stream stored, for assertions (direct gets by sequence, no consumer), and
waiting for what a stream is about to store (its arrivals, on a consumer) or for a consumer's client
to be done with what it took (its acks)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from nats.js.api import DeliverPolicy

from tests.chaos.checker import read_stream


async def stored_msgs(nc: Any, stream: str, subject: str | None = None) -> list[Any]:
    """Every message still stored in ``stream`` (optionally on one subject), oldest first.

    ``nc`` may be a connection or a JetStream context.
    """
    js = nc.jetstream() if hasattr(nc, "jetstream") else nc
    state = (await js.stream_info(stream)).state
    out = []
    for seq in range(state.first_seq or 1, (state.last_seq or 0) + 1):
        try:
            m = await js.get_msg(stream, seq)
        except Exception:  # noqa: BLE001 - deleted (work-queue or limits)
            continue
        if subject is None or m.subject == subject:
            out.append(m)
    return out


async def stored_json(nc: Any, stream: str, subject: str | None = None) -> list[Any]:
    """The stored bodies of ``stream`` decoded as JSON."""
    return [msgspec.json.decode(m.data) for m in await stored_msgs(nc, stream, subject)]


async def arrived(js: Any, stream: str, n: int = 1, subject: str | None = None, *, timeout: float) -> list[Any]:
    """Every message ``stream`` holds (on ``subject``), read once at least ``n`` have arrived there.

    The arrivals are awaited as they are delivered to an ordered consumer of the stream (what it held
    already, then each new message), not by reading the stream again and again; TimeoutError names
    the stream when fewer than ``n`` came within ``timeout``.
    """
    got = 0
    enough = asyncio.Event()

    async def one(_msg: Any) -> None:
        nonlocal got
        got += 1
        if got >= n:
            enough.set()

    sub = await js.subscribe(subject or ">", stream=stream, cb=one, ordered_consumer=True,
                             deliver_policy=DeliverPolicy.ALL)
    try:
        await asyncio.wait_for(enough.wait(), timeout)
    except TimeoutError:
        raise TimeoutError(f"{n} message(s) in {stream}{f' on {subject}' if subject else ''} not within "
                           f"{timeout} s ({got} came)") from None
    finally:
        await sub.unsubscribe()
    return await read_stream(js, stream, subject)


@contextlib.asynccontextmanager
async def acks(nc: Any, stream: str, durable: str) -> AsyncIterator[Callable[..., Awaitable[None]]]:
    """Follow the positive acks the client of ``durable`` sends for ``stream``'s messages, subscribed
    before the inputs are sent; yields ``wait(n, *, timeout)``, which returns once ``n`` have been sent.

    A client acks a message by publishing ``+ACK`` to its reply subject (``$JS.ACK.{stream}.{durable}.>``)
    once it is done with it: for the gateway, after every record the turn caused is stored and its raw
    message settled at rest (gateway/pipeline.py). So this waits on the event itself, where polling the
    stream's state would only see its effects."""
    count = 0
    waiters: list[tuple[int, asyncio.Future[None]]] = []

    async def seen(msg: Any) -> None:
        nonlocal count
        if msg.data in (b"+ACK", b""):
            count += 1
            for want, fut in waiters:
                if count >= want and not fut.done():
                    fut.set_result(None)

    async def wait(n: int, *, timeout: float) -> None:
        if count >= n:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append((n, fut))
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise TimeoutError(f"{n} ack(s) of {durable} on {stream} not within {timeout} s ({count} came)") from None

    sub = await nc.subscribe(f"$JS.ACK.{stream}.{durable}.>", cb=seen)
    try:
        yield wait
    finally:
        await sub.unsubscribe()

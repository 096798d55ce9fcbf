"""Reading back what a stream stored, for assertions (direct gets by sequence, no consumer), and
waiting for what a stream is about to store (its arrivals, on a consumer)."""

from __future__ import annotations

import asyncio
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

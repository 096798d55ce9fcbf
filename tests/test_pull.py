"""pgwcore.pull.fetch_ready against a real nats-server, held to nats-py's own fetch."""

from __future__ import annotations

import asyncio
import contextlib

import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from pgwcore.pull import fetch_ready
from tests.polling import until, until_drained


async def _setup(nc, n: int, durable: str = "d"):
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="PULLT", subjects=["pullt.>"]))
    for i in range(n):
        await js.publish(f"pullt.{i}", f"m{i}".encode(), headers={"Nats-Msg-Id": f"id{i}"})
    return js, await js.pull_subscribe("pullt.>", durable=durable, stream="PULLT",
                                       config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30))


async def test_fetch_ready_takes_the_ready_batch_in_order(nc) -> None:
    js, sub = await _setup(nc, 300)
    first = await fetch_ready(sub, 256, timeout=2.0)
    assert [m.data for m in first] == [f"m{i}".encode() for i in range(256)]
    assert all(m.headers and m.headers["Nats-Msg-Id"] == f"id{i}" for i, m in enumerate(first))
    rest = await fetch_ready(sub, 256, timeout=2.0)  # fewer than asked are ready: the 404 ends the read
    assert [m.data for m in rest] == [f"m{i}".encode() for i in range(256, 300)]
    for m in first + rest:
        await m.ack()
    assert sub._sub._pending_size == 0  # the subscription's byte count kept as nats-py keeps it

    await until_drained(js, "PULLT", "d", timeout=10, what="every fetched message acked")
    await sub.unsubscribe()


async def test_fetch_ready_idle_waits_then_times_out_like_nats_py(nc) -> None:
    js, sub = await _setup(nc, 0)
    with pytest.raises(nats.errors.TimeoutError):
        await fetch_ready(sub, 16, timeout=0.3)
    # A message published while the lingering request waits is delivered to it.

    async def later() -> None:  # once the lingering request is registered on the server
        async def lingering() -> bool:
            return (await js.consumer_info("PULLT", "d")).num_waiting >= 1

        await until(lingering, timeout=3, interval=0.01, what="the lingering pull request")
        await js.publish("pullt.x", b"late")

    task = asyncio.ensure_future(later())
    got = await fetch_ready(sub, 16, timeout=3.0)
    await task
    assert [m.data for m in got] == [b"late"]
    await sub.unsubscribe()


async def test_every_timeout_is_nats_py_s_timeout_error(nc, monkeypatch) -> None:
    """The probe's own deadline, and nats-py's fetch raising the bare TimeoutError (which it does
    when its probe's answer takes the whole time: a loaded machine, CI stop 36), both come out as
    ``nats.errors.TimeoutError``, what the docstring promises."""
    _js, sub = await _setup(nc, 0)
    with pytest.raises(nats.errors.TimeoutError):
        await fetch_ready(sub, 16, timeout=1e-6)  # the probe's answer cannot come this fast

    async def bare(*a: object, **k: object) -> None:  # nats-py's path, injected: it needs a loaded machine
        raise TimeoutError

    monkeypatch.setattr(sub, "fetch", bare)
    with pytest.raises(nats.errors.TimeoutError):
        await fetch_ready(sub, 16, timeout=0.3)
    await sub.unsubscribe()


async def test_unacked_messages_are_redelivered(nc) -> None:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="PULLT", subjects=["pullt.>"]))
    for i in range(5):
        await js.publish(f"pullt.{i}", f"m{i}".encode())
    sub = await js.pull_subscribe("pullt.>", durable="r", stream="PULLT",
                                  config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=1))
    got = await fetch_ready(sub, 10, timeout=2.0)
    assert len(got) == 5
    await got[0].ack()
    for m in got[1:]:
        await m.nak()
    # The server handles naks apart from pulls: a no-wait pull right after them may find only
    # some redelivered yet, so pull until all four are back (each pull asks for what is ready).
    again: list = []
    async with asyncio.timeout(10):
        while len(again) < 4:
            with contextlib.suppress(nats.errors.TimeoutError):
                got = await fetch_ready(sub, 10, timeout=1.0)
                for m in got:  # acked at once, so none comes a third time (ack_wait is 1 s)
                    await m.ack()
                again += got
    assert sorted(m.data for m in again) == [b"m1", b"m2", b"m3", b"m4"]
    assert all(m.metadata.num_delivered == 2 for m in again)
    await sub.unsubscribe()

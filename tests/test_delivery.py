"""pgwcore.delivery: a subscription's messages handed over in the read loop, against a real nats-server."""

from __future__ import annotations

import asyncio
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NoStreamResponseError

from pgwcore.atomic import publish_acked
from pgwcore.connect import connect
from pgwcore.delivery import deliver_inline
from tests.polling import until


async def _sub(nc: Any, subject: str, handled: list[Any], **kw: Any) -> Any:
    async def never(msg: Msg) -> None:  # replaced before any message arrives
        raise AssertionError("the queued callback ran")

    sub = await nc.subscribe(subject, cb=never, **kw)
    deliver_inline(sub, lambda m: handled.append((m.data, asyncio.current_task())))
    return sub


async def test_messages_are_handled_in_order_in_the_read_loop_and_never_pile_up(nats_server: Any) -> None:
    """Every message goes to the function, in order, inside the connection's read loop, even far beyond the
    subscription's pending limit (nats-py's queue would have dropped them as a slow consumer)."""
    nc = await connect(nats_server.client_url)
    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    nc._error_cb = on_error
    try:
        handled: list[Any] = []
        sub = await _sub(nc, "inline.a", handled, pending_msgs_limit=2)
        for i in range(200):
            await nc.publish("inline.a", str(i).encode())
        await nc.flush()
        await nc.flush()  # the server's PONG comes after the 200 messages it sent
        assert [d for d, _t in handled] == [str(i).encode() for i in range(200)]
        assert {t for _d, t in handled} == {nc._reading_task}
        assert sub.pending_msgs == 0 and sub.pending_bytes == 0 and errors == []
    finally:
        await nc.close()


async def test_messages_queued_before_the_switch_reach_the_function_in_order(nc: Any) -> None:
    """Messages the subscription had queued, but its task had not taken, when the function is put in place are
    handed to it first, in order, then the later ones; subscribe_inline subscribes and switches in one call."""
    from pgwcore.delivery import subscribe_inline

    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(msg: Msg) -> None:  # holds the first message, so the next ones stay queued
        entered.set()
        await release.wait()

    sub = await nc.subscribe("inline.q", cb=slow)
    for i in range(3):
        await nc.publish("inline.q", str(i).encode())
    await nc.flush()
    await entered.wait()

    async def queued() -> bool:
        return sub._pending_queue.qsize() == 2

    await until(queued, timeout=5, what="two messages queued behind the held one")
    handled: list[bytes] = []
    deliver_inline(sub, lambda m: handled.append(m.data))
    await nc.publish("inline.q", b"3")

    async def three() -> bool:
        return len(handled) >= 3

    await until(three, timeout=5, what="the message sent after the switch")
    assert handled == [b"1", b"2", b"3"]
    await sub.unsubscribe()
    got: list[bytes] = []
    sub2 = await subscribe_inline(nc, "inline.r", lambda m: got.append(m.data))
    await nc.publish("inline.r", b"x")

    async def one() -> bool:
        return bool(got)

    await until(one, timeout=5, what="the message of the subscribe_inline subscription")
    assert got == [b"x"]
    await sub2.unsubscribe()


async def test_an_error_of_the_function_is_logged_and_the_next_message_handled(nc: Any) -> None:
    """A function that raises on one message does not stop the delivery of the next ones."""
    seen: list[bytes] = []

    def handle(m: Msg) -> None:
        seen.append(m.data)
        if m.data == b"bad":
            raise ValueError("refused")

    async def never(msg: Msg) -> None:
        raise AssertionError("the queued callback ran")

    sub = await nc.subscribe("inline.b", cb=never)
    deliver_inline(sub, handle)
    for d in (b"one", b"bad", b"two"):
        await nc.publish("inline.b", d)
    await nc.flush()
    await nc.flush()
    assert seen == [b"one", b"bad", b"two"]


async def test_unsubscribe_and_drain_still_end_an_inline_subscription(nc: Any) -> None:
    """Drain and unsubscribe end an inline subscription: nothing is handled after."""
    handled: list[Any] = []
    a = await _sub(nc, "inline.c", handled)
    b = await _sub(nc, "inline.d", handled)
    await nc.publish("inline.c", b"before")
    await nc.flush()
    await asyncio.wait_for(a.drain(), 5)
    await b.unsubscribe()
    await nc.publish("inline.c", b"after")
    await nc.publish("inline.d", b"after")
    await nc.flush()
    await nc.flush()
    assert [d for d, _t in handled] == [b"before"]


async def test_inline_delivery_survives_a_reconnect(nats_server: Any) -> None:
    """After the server dies and comes back, the inline subscription still hands over its messages (nats-py
    resubscribes the same subscriptions), and PubAcks still come back."""
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    async def quiet(_e: Exception) -> None:
        return None

    nc = await connect(nats_server.client_url, reconnect_time_wait=0.05, max_reconnect_attempts=-1,
                       reconnected_cb=on_reconnect, error_cb=quiet)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="INR", subjects=["inr.>"], storage=StorageType.FILE))
        handled: list[Any] = []
        await _sub(nc, "inline.r", handled)
        assert (await publish_acked(nc, "inr.1", b"x", {}, 5)).seq == 1
        nats_server.kill()
        await nats_server.wait_exit()
        await nats_server.restart()
        await asyncio.wait_for(reconnected.wait(), 20)
        await nc.publish("inline.r", b"after")
        await nc.flush()
        await nc.flush()
        assert [d for d, _t in handled] == [b"after"]

        async def stored() -> Any:
            try:
                return await publish_acked(nc, "inr.2", b"y", {"Nats-Msg-Id": "inr-2"}, 10)
            except NoStreamResponseError:  # JetStream still recovering after the restart: nothing stored
                return None

        ack = await until(stored, timeout=20, what="a PubAck after the restart")
        assert (ack.stream, ack.seq) == ("INR", 2)
    finally:
        await nc.close()


async def test_the_kernels_batched_reads_and_requests_are_handed_over_inline(make_config: Any, nc: Any, tmp_path: Any) -> None:
    """The kernel's batched-read replies, its transition requests and the PubAcks of its writes (its own inbox, shared
    by the log and the state) no longer go through a queue and a task of their subscription: all hand their messages
    over in the read loop, and requests are answered as before, no write left waiting."""
    import uuid

    from gateway.kernel.service import KernelService
    from subjects.idp import Permit
    from tests.kernel_support import (
        Issuer,
        idp,
        kernel_config,
        policy_dir,
        request,
        running_gateway,
    )

    issuer = Issuer(tmp_path / "issuer")
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent="a1", so_id=so)
    async with running_gateway(kernel_config(make_config, issuer, policy_dir(tmp_path)), nc) as gw:
        kernel = next(p for p in gw.parts if isinstance(p, KernelService))
        assert kernel.state.acks is kernel.eventlog.acks
        for sub in (kernel._sub, kernel.state._batch._replies.sub, kernel.eventlog.acks._replies.sub):
            await asyncio.wait({sub._wait_for_msgs_task}, timeout=5)  # cancelled by deliver_inline
            assert sub._wait_for_msgs_task.done()
        results = await asyncio.gather(*(
            request(nc, "a1", {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking",
                                                             session=f"s-{i}")}) for i in range(20)))
        assert all(isinstance(r, Permit) for r in results), results
        assert kernel._sub.pending_msgs == 0
        assert not kernel.eventlog.acks._waiters

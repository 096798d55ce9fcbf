"""JetStream atomic batches (pgwcore/atomic.py) against a real nats-server: all or nothing."""

from __future__ import annotations

from typing import Any

import nats.errors
import pytest
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import APIError, NoStreamResponseError

from pgwcore.atomic import (
    ERR_ATOMIC_DISABLED,
    ERR_BATCH_DUPLICATE_MSG_ID,
    ERR_WRONG_LAST_SEQ,
    MAX_BATCH,
    enable_atomic,
    publish_acked,
    publish_atomic,
)
from tests.polling import until


async def _stream(js: Any, name: str, *, atomic: bool) -> None:
    await js.add_stream(StreamConfig(name=name, subjects=[f"{name.lower()}.>"], storage=StorageType.FILE,
                                     duplicate_window=60, allow_atomic=atomic or None))


def _items(name: str, ids: list[str]) -> list[tuple[str, bytes, dict[str, str]]]:
    return [(f"{name.lower()}.{i}", f"body-{i}".encode(), {"Nats-Msg-Id": i}) for i in ids]


async def test_a_batch_is_stored_whole_in_order(nc: Any) -> None:
    js = nc.jetstream()
    await _stream(js, "AT1", atomic=True)
    ack = await publish_atomic(nc, _items("AT1", ["a", "b", "c"]))
    assert (ack.stream, ack.seq, ack.batch_size) == ("AT1", 3, 3)
    assert [(await js.get_msg("AT1", s)).data for s in (1, 2, 3)] == [b"body-a", b"body-b", b"body-c"]


async def test_a_refused_batch_stores_nothing(nc: Any) -> None:
    js = nc.jetstream()
    await _stream(js, "AT2", atomic=True)
    await publish_atomic(nc, _items("AT2", ["a"]))
    with pytest.raises(APIError) as dup:  # one id already stored: the whole batch is refused
        await publish_atomic(nc, _items("AT2", ["x", "a", "y"]))
    assert dup.value.err_code == ERR_BATCH_DUPLICATE_MSG_ID
    with pytest.raises(APIError) as seq:  # the expected last sequence is checked before the batch
        await publish_atomic(nc, _items("AT2", ["p", "q"]), first_headers={"Nats-Expected-Last-Sequence": "7"})
    assert seq.value.err_code == ERR_WRONG_LAST_SEQ
    assert (await js.stream_info("AT2")).state.messages == 1
    ok = await publish_atomic(nc, _items("AT2", ["p", "q"]), first_headers={"Nats-Expected-Last-Sequence": "1"})
    assert ok.seq == 3


async def test_a_stream_without_the_flag_refuses_until_enabled(nc: Any) -> None:
    js = nc.jetstream()
    await _stream(js, "AT3", atomic=False)
    with pytest.raises(APIError) as off:
        await publish_atomic(nc, _items("AT3", ["a", "b"]))
    assert off.value.err_code == ERR_ATOMIC_DISABLED
    assert await enable_atomic(js, "AT3") is True
    assert (await js.stream_info("AT3")).config.allow_atomic is True
    assert (await publish_atomic(nc, _items("AT3", ["a", "b"]))).seq == 2
    assert await enable_atomic(js, "NO_SUCH_STREAM") is False


async def test_batch_size_limits_are_refused_before_sending(nc: Any) -> None:
    with pytest.raises(ValueError, match="at least one"):
        await publish_atomic(nc, [])
    with pytest.raises(ValueError, match=f"at most {MAX_BATCH}"):
        await publish_atomic(nc, _items("AT4", [str(i) for i in range(MAX_BATCH + 1)]))


async def test_publish_acked_answers_as_js_publish_does(nc: Any) -> None:
    """The plain write: the stored sequence, the duplicate flag, the server's refusal as APIError,
    no stream as NoStreamResponseError, no answer as nats' TimeoutError; nothing left in the request map."""
    js = nc.jetstream()
    await _stream(js, "AT9", atomic=False)
    first = await publish_acked(nc, "at9.a", b"1", {"Nats-Msg-Id": "m1"}, 5)
    again = await publish_acked(nc, "at9.a", b"1", {"Nats-Msg-Id": "m1"}, 5)
    assert (first.seq, first.duplicate, again.seq, again.duplicate) == (1, False, 1, True)
    ref = await js.publish("at9.b", b"2", headers={"Nats-Msg-Id": "m2"})
    assert (ref.seq, bool(ref.duplicate)) == (2, False)
    with pytest.raises(APIError) as e:
        await publish_acked(nc, "at9.c", b"3", {"Nats-Expected-Last-Subject-Sequence": "7"}, 5)
    assert e.value.err_code == ERR_WRONG_LAST_SEQ
    with pytest.raises(APIError) as e:
        await publish_acked(nc, "at9.c", b"3", {"Nats-Expected-Stream": "OTHER"}, 5)
    assert e.value.code == 400
    assert (await js.stream_info("AT9")).state.messages == 2
    with pytest.raises(NoStreamResponseError):
        await publish_acked(nc, "nostream.x", b"", {}, 5)
    silent = await nc.subscribe("silent.x")  # a listener that never answers: no 503, no ack
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await publish_acked(nc, "silent.x", b"", {}, 0.2)
    finally:
        await silent.unsubscribe()
    assert not nc._resp_map


async def test_send_acked_leaves_nothing_behind_after_an_answer_a_refusal_a_cancel(nc: Any) -> None:
    """The futures of send_acked resolve with their own PubAcks in any order of awaiting; a write refused before it is
    sent (a subject with a space) leaves no waiter in the request map; a future cancelled by its caller is not resolved
    by the PubAck that comes after, and its waiter leaves the map when its timer passes."""
    from pgwcore.atomic import send_acked

    js = nc.jetstream()
    await _stream(js, "AT10", atomic=False)
    futs = [await send_acked(nc, "at10.a", str(i).encode(), {}, 5) for i in range(3)]
    assert [(await f).seq for f in reversed(futs)] == [3, 2, 1]
    assert not nc._resp_map
    with pytest.raises(nats.errors.BadSubjectError):
        await send_acked(nc, "at10 a", b"x", {}, 5)
    assert not nc._resp_map
    fut = await send_acked(nc, "at10.a", b"late", {}, 0.3)
    fut.cancel()
    assert (await publish_acked(nc, "at10.a", b"after", {}, 5)).seq == 5  # the cancelled one was stored (4) meanwhile
    assert fut.cancelled() and len(nc._resp_map) == 1
    async def gone() -> bool:  # the cancelled waiter's own timer (0.3 s) takes it out
        return not nc._resp_map

    assert await until(gone, timeout=5, interval=0.02, what="the cancelled waiter leaving the request map")


async def test_ack_inbox_answers_as_send_acked_does_on_an_inbox_of_its_own(nats_server: Any, nc: Any) -> None:
    """AckInbox.send resolves each write with its own PubAck in any order of awaiting, the server's refusal as APIError,
    no stream as NoStreamResponseError, no answer as nats' TimeoutError, all on its own inbox (the connection's request
    inbox is never made) with no waiter left behind; a cancelled caller is not resolved by the PubAck after; before
    start and after close it is send_acked through the request inbox."""
    from pgwcore.atomic import AckInbox
    from pgwcore.connect import connect

    await _stream(nc.jetstream(), "AT11", atomic=False)
    nc = await connect(nats_server.client_url)  # a connection of its own: no request made on it
    try:
        acks = AckInbox(nc)
        await acks.start()
        futs = [await acks.send("at11.a", str(i).encode(), {"Nats-Msg-Id": f"m{i}"}, 5) for i in range(3)]
        assert [(await f).seq for f in reversed(futs)] == [3, 2, 1]
        again = await acks.publish("at11.a", b"0", {"Nats-Msg-Id": "m0"}, 5)
        assert (again.seq, again.duplicate) == (1, True)
        with pytest.raises(APIError) as e:
            await acks.publish("at11.c", b"3", {"Nats-Expected-Last-Subject-Sequence": "7"}, 5)
        assert e.value.err_code == ERR_WRONG_LAST_SEQ
        with pytest.raises(NoStreamResponseError):
            await acks.publish("nostream.x", b"", {}, 5)
        with pytest.raises(nats.errors.BadSubjectError):
            await acks.send("at11 a", b"x", {}, 5)
        silent = await nc.subscribe("silent.y")  # a listener that never answers: no 503, no ack
        try:
            with pytest.raises(nats.errors.TimeoutError):
                await acks.publish("silent.y", b"", {}, 0.2)
        finally:
            await silent.unsubscribe()
        fut = await acks.send("at11.a", b"late", {}, 5)
        fut.cancel()
        assert (await acks.publish("at11.a", b"after", {}, 5)).seq == 5  # the cancelled one was stored (4) meanwhile
        assert fut.cancelled() and not acks._waiters
        assert nc._resp_sub_prefix is None and not nc._resp_map  # nothing went through the request inbox
        assert acks._replies.sub._wait_for_msgs_task.done()  # handed over in the read loop (pgwcore.delivery)
        await acks.close()
        assert (await acks.publish("at11.a", b"closed", {}, 5)).seq == 6
        assert nc._resp_sub_prefix is not None  # send_acked's request inbox, once closed
    finally:
        await nc.close()


async def test_deadlines_expire_each_unanswered_waiter_once_never_before_its_own_deadline() -> None:
    """Deadlines on one timer: waiters of three timeouts, a third of them answered before their deadline; each
    unanswered one is expired exactly once and not before its own deadline, the answered never, nothing is kept."""
    import asyncio
    import random

    from pgwcore.atomic import Deadlines

    loop = asyncio.get_running_loop()
    pending: dict[str, float] = {}
    expired: dict[str, float] = {}
    done = loop.create_future()
    rnd = random.Random(7)
    want = {str(i) for i in range(90) if i % 3}  # the others are answered
    deadlines: dict[str, float] = {}  # the deadline a timer of its own would have had

    def expire(token: str) -> None:
        assert token not in expired
        expired[token] = loop.time()
        pending.pop(token)
        if set(expired) == want and not done.done():
            done.set_result(None)

    d = Deadlines(pending, expire)

    def add(start: int) -> None:  # ten waiters a turn of the loop, as writes come in over time
        for i in range(start, start + 10):
            token, timeout = str(i), rnd.choice([0.05, 0.15, 0.3])
            pending[token] = loop.time() + timeout
            d.add(loop, token, timeout)
            if token in want:
                deadlines[token] = pending[token]
            else:
                del pending[token]  # answered
        if start + 10 < 90:
            loop.call_soon(add, start + 10)

    add(0)
    await asyncio.wait_for(done, 5)
    assert set(expired) == want
    assert all(expired[t] >= deadlines[t] for t in want)
    assert d._timer is None and not any(d._queues.values())


async def test_a_reply_that_is_no_acknowledgement_is_not_taken_for_one() -> None:
    """A publish's reply inbox is a subject others can answer on (docs/security.md "Replies": a read-only party saw
    the services' reply subjects and aimed the capability document at them first). A reply naming no stream and
    sequence fails the write instead of completing it; the server's own acknowledgement still completes it."""
    import asyncio
    from types import SimpleNamespace

    from pgwcore.atomic import NotAnAckError, _answer

    loop = asyncio.get_running_loop()
    for forged in (b'{"supportedEnvelopes": ["binding_moment"], "limits": {}}', b"{}", b'{"stream": "", "seq": 0}'):
        out = loop.create_future()
        _answer(SimpleNamespace(headers=None, data=forged), out)
        with pytest.raises(NotAnAckError):
            out.result()
    out = loop.create_future()
    _answer(SimpleNamespace(headers=None, data=b'{"stream": "PGW_VERDICTS", "seq": 7}'), out)
    assert out.result().seq == 7

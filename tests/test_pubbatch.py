"""pgwcore.pubbatch: a run of publishes / acks queued at once, the same bytes nats-py's publish sends."""

from __future__ import annotations

from typing import Any

import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

from pgwcore.pubbatch import ack_all, publish_many, publish_one, publish_soon
from tests.polling import until

HEADERS = [
    None,
    {"Nats-Msg-Id": "a1", "Pgw-Capsule-Id": "f" * 64, "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
    {" Padded-Key ": "  padded value  ", "Line": "one\r\ntwo\nthree"},  # trimmed, CR/LF turned into spaces
    {"Unicode": "é ✓"},
]


def _record(nc: Any, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    sent: list[bytes] = []
    real = nc._send_command

    async def send(cmd: bytes, priority: bool = False) -> None:
        sent.append(bytes(cmd))
        await real(cmd, priority)

    monkeypatch.setattr(nc, "_send_command", send)
    return sent


async def test_publish_many_sends_the_bytes_nats_py_sends(nc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of messages with and without headers is queued as exactly the bytes nats-py's publish would queue."""
    items = [(f"pb.bytes.{i}", f"payload {i}".encode() * (i + 1), h) for i, h in enumerate(HEADERS)]
    sent = _record(nc, monkeypatch)
    for subject, payload, headers in items:
        await nc.publish(subject, payload, headers=headers)
    theirs = b"".join(sent)
    sent.clear()
    await publish_many(nc, items)
    assert len(sent) == 1  # one command for the whole run
    assert sent[0] == theirs


async def test_publish_many_refuses_what_nats_py_refuses(nc: Any) -> None:
    """A subject with whitespace, a header key that is no token and an oversized payload are refused, nothing sent."""
    with pytest.raises(nats.errors.BadSubjectError):
        await publish_many(nc, [("pb.ok", b"x", None), ("pb.bad subject", b"x", None)])
    with pytest.raises(nats.errors.BadHeaderError):
        await publish_many(nc, [("pb.ok", b"x", {"Bad:Key": "v"})])
    with pytest.raises(nats.errors.MaxPayloadError):
        await publish_many(nc, [("pb.ok", b"x" * (nc.max_payload + 1), None)])


async def test_published_run_and_its_acks_reach_the_server(nc: Any) -> None:
    """Messages sent by publish_many are stored in order with their headers, and ack_all acks every one."""
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="PBR", subjects=["pbr.>"], storage=StorageType.FILE))
    await publish_many(nc, [(f"pbr.{i}", f"m{i}".encode(), {"Nats-Msg-Id": f"id-{i}"}) for i in range(50)])
    end = await js.publish("pbr.end", b"end")  # acked after everything sent before it on this connection
    assert end.seq == 51
    first = await js.get_msg("PBR", 1)
    assert (first.data, first.headers["Nats-Msg-Id"]) == (b"m0", "id-0")
    psub = await js.pull_subscribe("pbr.>", durable="pbr", stream="PBR",
                                   config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30))
    msgs = await psub.fetch(51, timeout=5)
    assert [m.data for m in msgs] == [f"m{i}".encode() for i in range(50)] + [b"end"]
    await ack_all(nc, msgs)
    with pytest.raises(nats.errors.MsgAlreadyAckdError):
        await ack_all(nc, msgs[:1])  # as Msg.ack: a message is acked once
    async def applied() -> object:  # the server applies the acks it was sent; no event announces it
        ci = await psub.consumer_info()
        return ci if ci.num_ack_pending == 0 else None

    ci = await until(applied, timeout=5, interval=0.02, what="the acks applied")
    assert ci.num_ack_pending == 0
    assert ci.ack_floor.stream_seq == 51


@pytest.mark.parametrize("publish_one", [publish_one, publish_soon])
async def test_publish_one_sends_the_bytes_nats_py_sends(nc: Any, monkeypatch: pytest.MonkeyPatch, publish_one: Any) -> None:
    """One message with a reply subject, with and without headers, is queued as exactly the bytes nats-py's publish queues
    (publish_one, and publish_soon, its variant written by a loop callback)."""
    sent = _record(nc, monkeypatch)
    for i, h in enumerate(HEADERS):
        await nc.publish(f"pb.one.{i}", b"payload" * (i + 1), reply=f"_INBOX.x.{i}", headers=h)
        theirs = sent.pop()
        await publish_one(nc, f"pb.one.{i}", b"payload" * (i + 1), h, f"_INBOX.x.{i}")
        assert sent.pop() == theirs
    await nc.publish("pb.one.noreply", b"p")
    theirs = sent.pop()
    await publish_one(nc, "pb.one.noreply", b"p")
    assert sent.pop() == theirs


@pytest.mark.parametrize("publish_one", [publish_one, publish_soon])
async def test_publish_one_refuses_what_nats_py_refuses(nc: Any, publish_one: Any) -> None:
    """A subject or reply with whitespace, a header key that is no token and an oversized payload are refused."""
    with pytest.raises(nats.errors.BadSubjectError):
        await publish_one(nc, "pb.bad subject", b"x")
    with pytest.raises(nats.errors.BadSubjectError):
        await publish_one(nc, "pb.ok", b"x", None, "bad reply")
    with pytest.raises(nats.errors.BadHeaderError):
        await publish_one(nc, "pb.ok", b"x", {"Bad:Key": "v"}, "r")
    with pytest.raises(nats.errors.MaxPayloadError):
        await publish_one(nc, "pb.ok", b"x" * (nc.max_payload + 1), None, "r")


def _writes(nc: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, Any]]:
    """Each socket write of the connection: its bytes and the task that made it (None: a loop callback)."""
    import asyncio

    writes: list[tuple[bytes, Any]] = []
    real = nc._transport.writelines

    def writelines(payload: list[bytes]) -> None:
        writes.append((b"".join(payload), asyncio.current_task()))
        real(payload)

    monkeypatch.setattr(nc._transport, "writelines", writelines)
    return writes


async def test_publish_soon_writes_what_one_turn_queued_at_once_in_order_without_the_flusher(
    nc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Messages queued by publish_soon in one turn, with a plain nc.publish between them, leave in one socket write, in
    the order they were queued, made by a loop callback and not by nats-py's flusher task, and arrive in that order."""
    got: list[bytes] = []

    async def cb(m: Any) -> None:
        got.append(m.data)

    sub = await nc.subscribe("pb.soon.>", cb=cb)
    await nc.flush()
    writes = _writes(nc, monkeypatch)
    await publish_soon(nc, "pb.soon.a", b"1", {"Nats-Msg-Id": "s1"}, "_INBOX.s.1")
    await nc.publish("pb.soon.b", b"2")
    await publish_soon(nc, "pb.soon.c", b"3")
    await nc.flush()
    first, task = writes[0]
    assert task is None  # a loop callback's write, not the flusher task's
    assert first.startswith(b"HPUB pb.soon.a _INBOX.s.1 ")
    assert first.index(b"pb.soon.a") < first.index(b"PUB pb.soon.b") < first.index(b"PUB pb.soon.c")  # one write, in order

    async def arrived() -> bool:
        return len(got) == 3

    await until(arrived, timeout=5, what="the three messages")
    assert got == [b"1", b"2", b"3"]
    await sub.unsubscribe()


async def test_publish_soon_leaves_the_write_to_the_flusher_while_the_socket_holds_unsent_data(
    nc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the transport still holds unsent bytes (the socket is not keeping up), publish_soon does not write past
    nats-py's flusher: the write is made by the flusher task, which waits for the drain as it does for nc.publish."""
    writes = _writes(nc, monkeypatch)
    monkeypatch.setattr(nc._transport._io_writer.transport, "get_write_buffer_size", lambda: 1)
    await publish_soon(nc, "pb.soon.slow", b"x")
    await nc.flush()
    assert writes and all(task is nc._flusher_task for _, task in writes)
    assert b"pb.soon.slow" in writes[0][0]

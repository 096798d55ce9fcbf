"""pgwcore.pubbatch: a run of publishes / acks queued at once, the same bytes nats-py's publish sends."""

from __future__ import annotations

from typing import Any

import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

from pgwcore.pubbatch import ack_all, publish_many, publish_one
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


async def test_publish_one_sends_the_bytes_nats_py_sends(nc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One message with a reply subject, with and without headers, is queued as exactly the bytes nats-py's publish queues."""
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


async def test_publish_one_refuses_what_nats_py_refuses(nc: Any) -> None:
    """A subject or reply with whitespace, a header key that is no token and an oversized payload are refused."""
    with pytest.raises(nats.errors.BadSubjectError):
        await publish_one(nc, "pb.bad subject", b"x")
    with pytest.raises(nats.errors.BadSubjectError):
        await publish_one(nc, "pb.ok", b"x", None, "bad reply")
    with pytest.raises(nats.errors.BadHeaderError):
        await publish_one(nc, "pb.ok", b"x", {"Bad:Key": "v"}, "r")
    with pytest.raises(nats.errors.MaxPayloadError):
        await publish_one(nc, "pb.ok", b"x" * (nc.max_payload + 1), None, "r")

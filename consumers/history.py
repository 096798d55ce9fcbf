"""Read a stream's history without a consumer: the ops read path (issue 19).

Ops are read-only (DESIGN §1, §7): they may not create, pause, pull from or
ack any consumer, because every one of those changes state someone else relies
on (a pause withholds a principal's surface, a pull on another's durable hides
a message from its owner until the ack wait, an ack on the registration work
queue deletes it). NATS wildcards match whole tokens only, so a consumer-name
prefix cannot be granted either. ``pgw tail`` and ``pgw replay`` therefore read
history one message at a time with ``$JS.API.STREAM.MSG.GET`` and
``next_by_subj``: in stream order, acknowledging nothing, touching no consumer.
It is one request per message (``pgwcore.msgget``), which is fine for an
operator's view and a bounded replay.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime

from nats.aio.client import Client

from pgwcore.msgget import stored_on


@dataclass(frozen=True)
class StoredMsg:
    """One stored message as read by message get."""

    stream: str
    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)
    time: datetime | None = None


async def read_stored(
    nc: Client,
    stream: str,
    subject: str | None = None,
    *,
    from_seq: int = 1,
    to_seq: int | None = None,
) -> AsyncIterator[StoredMsg]:
    """Yield the messages of ``stream`` matching ``subject`` (any if None) in [from_seq, to_seq]."""
    js = nc.jetstream()
    if to_seq is None:
        to_seq = (await js.stream_info(stream)).state.last_seq
    async for raw in stored_on(js, stream, subject or ">", from_seq, to_seq):
        yield StoredMsg(stream, raw.seq or 0, raw.subject or "", raw.data or b"", dict(raw.headers or {}), raw.time)

"""A stream's messages, read by message get: no consumer at all.

The read path of ops credentials (DESIGN §7): they may read every stream but may
not create, pull from or ack a consumer, since each of those changes state
someone else relies on. ``$JS.API.STREAM.MSG.GET`` with ``next_by_subj`` reads
in stream order and changes nothing; it is one request per message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError


async def stored_on(js: JetStreamContext, stream: str, subject: str, from_seq: int,
                    to_seq: int) -> AsyncIterator[RawStreamMsg]:
    """Yield the messages of ``stream`` on ``subject`` (wildcards allowed) in [from_seq, to_seq], in order."""
    seq = max(1, from_seq)
    while seq <= to_seq:
        try:
            raw = await js.get_msg(stream, seq, subject=subject, next=True)
        except NotFoundError:
            return
        if raw.seq is None or raw.seq > to_seq:
            return
        yield raw
        seq = raw.seq + 1


WINDOW = 64  # gets in flight while reading a range of sequences


async def stored_range(js: JetStreamContext, stream: str, first: int, last: int) -> AsyncIterator[RawStreamMsg]:
    """Yield the messages of ``stream`` at sequences [first, last], in order, ``WINDOW`` gets at a time.

    A sequence the stream no longer holds is skipped (a caller that must know compares sequences);
    sequence 0, which an empty stream reports as its first and last, is never asked for."""
    for start in range(max(1, first), last + 1, WINDOW):
        got = await asyncio.gather(*(js.get_msg(stream, s) for s in range(start, min(start + WINDOW, last + 1))),
                                   return_exceptions=True)
        for raw in got:
            if isinstance(raw, NotFoundError):
                continue
            if isinstance(raw, BaseException):
                raise raw
            yield raw

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


def subject_matches(pattern: str, subject: str) -> bool:
    """nats-server subject matching: ``*`` is one token, a final ``>`` is one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, t in enumerate(want):
        if t == ">":
            return len(have) > i
        if i >= len(have) or t not in ("*", have[i]):
            return False
    return len(want) == len(have)


def outside(subject: str | None, patterns: list[str]) -> bool:
    """Whether a stored message's subject is none of its stream's subjects (``patterns``, as configured).

    nats-server stores a message it delivers to a reply subject a stream captures under the message's own
    subject: a party's pull of its own consumer (``$JS.API.CONSUMER.MSG.NEXT``) with a store's subject as its
    reply subject put its outcome, with the gateway's bytes and ``Nats-Msg-Id``, in that store, under
    ``pgw.agent.{agent}.outcome`` (found by a docs-only attack: one in ``PGW_REVOKED`` stopped every later
    start of the gateway). No writer of the project's stores the like: such a record is foreign."""
    return not any(subject_matches(p, subject or "") for p in patterns)


async def last_seq_under(js: JetStreamContext, stream: str, subject: str) -> int:
    """The sequence of the last message of ``stream`` stored under ``subject`` (wildcards allowed), 0 if none.

    Not the stream's last sequence, which may be a message stored under another subject (``outside``): a
    reader that waits, through a watch of ``subject``, until it has seen the stream's last sequence would
    wait for ever."""
    try:
        raw = await js.get_msg(stream, subject=subject)
    except NotFoundError:
        return 0
    return raw.seq or 0


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

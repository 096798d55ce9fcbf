"""Many messages handed to the NATS connection at once, at a fraction of nats-py's cost per message.

nats-py's ``Client.publish`` validates the subject, checks every header key
against a regular expression and builds the header block byte by byte, then
queues the command and kicks its flusher: per call, for every message. The
signer writes three messages per capsule (its ledger link, the capsule, the
verdict's ack), so for a batch of 256 (its size then) that was a sizeable share of its event
loop. :func:`publish_many` and :func:`ack_all` write *the same protocol
bytes* ``Client.publish`` writes (``tests/test_pubbatch.py`` holds them to
it) for a whole run of messages and queue them as one command: one kick of
the flusher, one ``writelines`` entry.

The same checks as ``Client.publish``: a subject with whitespace, a header
key that is no RFC 7230 token and a payload over the server's max_payload
are refused (nats' own errors); header values are trimmed and CR/LF become
spaces, as nats-py does. A connection that is not connected (reconnecting,
draining, closed) goes through ``Client.publish`` one message at a time, so
its buffering limits and errors stay nats-py's.

This reads nats-py internals (``_send_command``, ``_flush_queue``,
``_flush_pending``, ``_max_payload``, ``stats``, ``Msg._ackd``), as nats-py 2.x
defines them, like :mod:`pgwcore.pull`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from nats import errors
from nats.aio.client import _HEADER_KEY_RE, _HEADER_VALUE_NEWLINES, _validate_subject

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

_KEYS: dict[str, str] = {}  # header keys already checked: key -> the key as written ("" to skip it)


def _key(k: str) -> str:
    """``k`` as nats-py writes it, "" for a key it skips; BadHeaderError if it is no token."""
    got = _KEYS.get(k)
    if got is not None:
        return got
    key = k.strip()
    if key and not _HEADER_KEY_RE.fullmatch(key):
        raise errors.BadHeaderError(key)
    _KEYS[k] = key
    return key


def header_block(headers: Mapping[str, str]) -> bytes:
    """The header block nats-py's ``Client.publish`` sends for ``headers`` (NATS/1.0, one line each)."""
    lines = ["NATS/1.0\r\n"]
    for k, v in headers.items():
        key = _key(k)
        if not key:
            continue
        value = v.strip()
        if "\r" in value or "\n" in value:
            value = value.translate(_HEADER_VALUE_NEWLINES)
        lines.append(f"{key}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode()


def pub_command(subject: str, payload: bytes, headers: Mapping[str, str] | None = None, reply: str = "") -> bytes:
    """The PUB / HPUB command of one message, byte for byte nats-py's (``nats.protocol.command``)."""
    if headers is None:
        return b"".join((f"PUB {subject} {reply} {len(payload)}\r\n".encode(), payload, b"\r\n"))
    hdr = header_block(headers)
    return b"".join((f"HPUB {subject} {reply} {len(hdr)} {len(hdr) + len(payload)}\r\n".encode(), hdr, payload,
                     b"\r\n"))


async def _send(nc: Client, cmds: list[bytes], count: int, size: int) -> None:
    nc.stats["out_msgs"] += count
    nc.stats["out_bytes"] += size
    await nc._send_command(b"".join(cmds))
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()


def _checked(nc: Client, subject: str, payload: bytes, headers: Mapping[str, str] | None, reply: str = "") -> bytes:
    """The command of one message, after the checks ``nc.publish`` makes (subjects, max payload)."""
    if not nc._skip_subject_validation:
        _validate_subject(subject)
        if reply:
            _validate_subject(reply)
    if len(payload) > nc._max_payload:
        raise errors.MaxPayloadError
    return pub_command(subject, payload, headers, reply)


async def publish_many(nc: Client, items: Iterable[tuple[str, bytes, Mapping[str, str] | None]]) -> None:
    """Publish ``(subject, payload, headers)`` in order, no reply subjects: what ``nc.publish``
    of each would send, queued as one command."""
    items = list(items)
    if not items:
        return
    if not nc.is_connected:  # reconnecting, draining, closed: nats-py's own limits and errors
        for subject, payload, headers in items:
            await nc.publish(subject, payload, headers=dict(headers) if headers is not None else None)
        return
    cmds = [_checked(nc, subject, payload, headers) for subject, payload, headers in items]
    await _send(nc, cmds, len(cmds), sum(len(payload) for _, payload, _ in items))


async def publish_one(nc: Client, subject: str, payload: bytes, headers: Mapping[str, str] | None = None,
                      reply: str = "") -> None:
    """``await nc.publish(subject, payload, reply=reply, headers=headers)``: the same bytes and
    the same refusals, at a fraction of its CPU (the kernel's durable writes, one per call)."""
    if not nc.is_connected:  # reconnecting, draining, closed: nats-py's own limits and errors
        await nc.publish(subject, payload, reply=reply, headers=dict(headers) if headers is not None else None)
        return
    await _send(nc, [_checked(nc, subject, payload, headers, reply)], 1, len(payload))


def _write_soon(nc: Client) -> None:
    """The write nats-py's flusher would make next, made by a loop callback instead of a wakeup of its task.

    Hands the connection's pending commands (all of them, in order, whoever queued them) to the
    socket, as the flusher does. Where the flusher would do anything else, it is left to it: a
    connection that is not connected (reconnecting: nats-py sends the pending data once
    reconnected), a dead flusher, a transport that is not TCP, or one still holding unsent data
    (the socket is not keeping up: the flusher writes and waits for the drain, which is how
    nats-py holds back its publishers)."""
    nc._pgw_write_soon = None
    if nc._pending_data_size <= 0:
        return  # the flusher, or a forced flush, wrote it meanwhile
    writer = getattr(nc._transport, "_io_writer", None)
    flusher = nc._flusher_task
    if nc.is_connected and writer is not None and flusher is not None and not flusher.done() \
            and not writer.transport.get_write_buffer_size():
        try:
            nc._transport.writelines(nc._pending[:])
        except Exception:  # noqa: BLE001 - the flusher meets it again and handles it (nats-py's error path)
            pass
        else:
            nc._pending = []
            nc._pending_data_size = 0
            return
    if nc.is_connected and nc._flush_queue is not None and nc._flush_queue.empty():
        with contextlib.suppress(asyncio.QueueFull):  # full: the flusher is about to run anyway
            nc._flush_queue.put_nowait(asyncio.get_running_loop().create_future())  # kick the flusher


async def publish_soon(nc: Client, subject: str, payload: bytes, headers: Mapping[str, str] | None = None,
                       reply: str = "") -> None:
    """:func:`publish_one`, the write made by one loop callback per turn (:func:`_write_soon`) instead of
    a future put on the flusher's queue and a wakeup of its task: the same bytes and refusals, the same
    commands sent together (the callback runs where the flusher's wakeup would, after what this turn
    queued). For one hot path (the IDP kernel's four writes per PERMIT); the flusher stays for the rest."""
    if not nc.is_connected:  # reconnecting, draining, closed: nats-py's own limits and errors
        await nc.publish(subject, payload, reply=reply, headers=dict(headers) if headers is not None else None)
        return
    cmd = _checked(nc, subject, payload, headers, reply)
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += len(payload)
    await nc._send_command(cmd)  # over max_pending it flushes through the flusher and waits, as publish does
    loop = asyncio.get_running_loop()
    # One callback per turn: the loop it is armed on (a loop closed with it still pending does not hold it up).
    if getattr(nc, "_pgw_write_soon", None) is not loop:
        nc._pgw_write_soon = loop
        loop.call_soon(_write_soon, nc)


async def ack_all(nc: Client, msgs: Sequence[Msg]) -> None:
    """``await m.ack()`` for each of ``msgs``, in order, queued as one command.

    The same checks as ``Msg.ack``: a message without a reply subject
    (NotJSMessageError) or acked before (MsgAlreadyAckdError) raises before
    anything is sent.
    """
    if not msgs:
        return
    for m in msgs:
        if not m.reply:
            raise errors.NotJSMessageError
        if m._ackd:
            raise errors.MsgAlreadyAckdError(m)
    if not nc.is_connected:
        for m in msgs:
            await m.ack()
        return
    skip = nc._skip_subject_validation
    cmds = []
    for m in msgs:
        if not skip:
            _validate_subject(m.reply)
        cmds.append(f"PUB {m.reply}  0\r\n\r\n".encode())
    await _send(nc, cmds, len(cmds), 0)
    for m in msgs:
        m._ackd = True

"""Many messages handed to the NATS connection at once, at a fraction of nats-py's cost per message.

nats-py's ``Client.publish`` validates the subject, checks every header key
against a regular expression and builds the header block byte by byte, then
queues the command and kicks its flusher: per call, for every message. The
signer writes three messages per capsule (its ledger link, the capsule, the
verdict's ack), so for a batch of 256 that was a sizeable share of its event
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

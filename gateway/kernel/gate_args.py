"""A gated action's arguments that hold a secret: never in ``PGW_KERNEL_GATE``, erased once done.

The open dispatch (``OpenDispatch`` in ``PGW_KERNEL_GATE``) is the record a
crash is recovered from, so it must hold the arguments the executor is sent,
exactly as sent (docs/gate.md). A bucket made by the KV API keeps a deleted or
overwritten value's bytes in its block file (docs/security.md "Data at rest"),
so arguments that hold a secret (spec 002 SR-1: a ``pipeline.secrets`` value or
a ``secret:`` token, as the redactor judges them) are written apart, to the
erasable stream ``KV_PGW_ANSWER_TEXT`` under ``gate.{idempotency_key}``, and the
bucket's record holds their redacted form and ``arguments_seq``, the sequence
of the message that holds them as sent. Whoever reads the record back (the
approval of a HEM step, the sweep) reads the arguments by that sequence; once
the dispatch's record is deleted, the message is deleted with erase.

Order: the arguments are stored before the record that names them, and erased
after the record is deleted, so a crash leaves at worst the message without a
record (it ages out with the stream's 30 days), never a record whose arguments
are gone. A record whose arguments cannot be read (aged out, erased by hand) is
never dispatched with its redacted arguments: it is left for the operator.
"""

from __future__ import annotations

from typing import Any

import msgspec
from nats.js.errors import APIError, NotFoundError

from gateway.moments import TEXT_STREAM
from pgwcore.logs import get_logger

log = get_logger("pgw.kernel.gate")
# ``d`` below is a ``gateway.kernel.gate.OpenDispatch`` (not imported: gate.py imports this module).

SUBJECT = "$KV.PGW_ANSWER_TEXT.gate.{key}"
_enc = msgspec.json.Encoder()


class ArgumentsGone(Exception):
    """The arguments an open dispatch names by ``arguments_seq`` are not in the stream any more."""


async def stored(js: Any, red: Any, d: Any) -> bytes:
    """The bytes of ``d`` for ``PGW_KERNEL_GATE``: as it is when its arguments hold no secret; else with
    them redacted and ``arguments_seq`` naming the message that holds them as sent (written first, once)."""
    if d.arguments_seq is None:
        if not red.holding(d.arguments):
            return _enc.encode(d)
        ack = await js.publish(SUBJECT.format(key=d.idempotency_key), _enc.encode(d.arguments),
                               headers={"Nats-Msg-Id": f"gate-args:{d.idempotency_key}"})
        d.arguments_seq = ack.seq
    return _enc.encode(msgspec.structs.replace(d, arguments=red.graph(d.arguments)))


async def restored(js: Any, d: Any) -> Any:
    """``d`` as read from the bucket, with its arguments as sent (raises :class:`ArgumentsGone`)."""
    if d.arguments_seq is None:
        return d
    try:
        msg = await js.get_msg(TEXT_STREAM, d.arguments_seq)
    except (NotFoundError, APIError) as e:
        raise ArgumentsGone(f"the arguments of {d.idempotency_key} (sequence {d.arguments_seq}) are gone") from e
    if msg.subject != SUBJECT.format(key=d.idempotency_key):
        raise ArgumentsGone(f"sequence {d.arguments_seq} is not the arguments of {d.idempotency_key}")
    d.arguments = msgspec.json.decode(msg.data)
    return d


async def erase(js: Any, d: Any) -> None:
    """Delete, with erase, the message holding ``d``'s arguments (its record is deleted already)."""
    if d.arguments_seq is None:
        return
    try:
        await js.delete_msg(TEXT_STREAM, d.arguments_seq)  # without no_erase: the bytes are overwritten
    except APIError as e:  # erased already (a sweep and a dispatch both finishing it)
        log.debug("gate arguments already erased", seq=d.arguments_seq, error=str(e))

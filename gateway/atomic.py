"""JetStream atomic batch publish (nats-server >= 2.12, ADR-50).

A batch is a run of messages to one stream that is stored whole or not at all,
answered by a single PubAck on the commit message. Under ``sync_interval:
always`` the server syncs the batch once at commit instead of once per
message, which is what makes it worth having: the signer stores a batch of
capsules (and their ledger links) for the price of one durable write.

Headers: ``Nats-Batch-Id`` (unique per batch), ``Nats-Batch-Sequence`` (1..n)
and ``Nats-Batch-Commit: 1`` on the last message. ``Nats-Msg-Id`` dedup still
applies, but a batch holding a duplicate id is refused as a whole
(:data:`ERR_BATCH_DUPLICATE_MSG_ID`); ``Nats-Expected-Last-Sequence`` on the
first message is checked against the stream as it was before the batch. The
stream must have ``allow_atomic`` set (:func:`enable_atomic`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec
import nats.errors
from nats.js.api import PubAck
from nats.js.errors import APIError, NoStreamResponseError

from gateway.logs import get_logger

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.client import JetStreamContext

log = get_logger("pgw.atomic")

ERR_WRONG_LAST_SEQ = 10071  # JSStreamWrongLastSequenceErr
ERR_ATOMIC_DISABLED = 10174  # the stream does not allow atomic publish
ERR_BATCH_DUPLICATE_MSG_ID = 10201  # a Nats-Msg-Id in the batch was already stored
MAX_BATCH = 1000  # the server's per-batch message limit (ADR-50)

BatchItem = tuple[str, bytes, Mapping[str, str]]  # subject, payload, headers


async def publish_atomic(nc: Client, items: Sequence[BatchItem], *, timeout: float = 5.0,
                         first_headers: Mapping[str, str] | None = None) -> PubAck:
    """Publish ``items`` as one atomic batch; return the commit's PubAck.

    Raises ``APIError`` when the server refuses the batch (nothing of it is
    stored), ``NoStreamResponseError`` when no stream takes the subject, and
    nats' ``TimeoutError`` when the commit is not answered (then the batch may
    or may not be stored: callers treat it as a failure and rely on Msg-Id
    dedup when they retry).
    """
    if not items:
        raise ValueError("an atomic batch needs at least one message")
    if len(items) > MAX_BATCH:
        raise ValueError(f"an atomic batch holds at most {MAX_BATCH} messages, got {len(items)}")
    batch_id = secrets.token_hex(12)
    last = len(items) - 1
    for i, (subject, payload, headers) in enumerate(items):
        hdr = dict(headers)
        if i == 0 and first_headers:
            hdr.update(first_headers)
        hdr["Nats-Batch-Id"] = batch_id
        hdr["Nats-Batch-Sequence"] = str(i + 1)
        if i < last:
            await nc.publish(subject, payload, headers=hdr)
            continue
        hdr["Nats-Batch-Commit"] = "1"
        try:
            msg = await nc.request(subject, payload, timeout=timeout, headers=hdr)
        except nats.errors.NoRespondersError as e:
            raise NoStreamResponseError from e
    resp = json.loads(msg.data)
    if "error" in resp:
        raise APIError.from_error(resp["error"])
    return PubAck.from_response(resp)


class Ack(msgspec.Struct):
    """What a plain write needs of a PubAck (or of the API error instead)."""

    seq: int = 0
    duplicate: bool = False
    error: dict | None = None


_ack_dec = msgspec.json.Decoder(Ack)


def _expire(fut: asyncio.Future[object]) -> None:
    if not fut.done():
        fut.set_exception(nats.errors.TimeoutError())


async def publish_acked(nc: Client, subject: str, payload: bytes, headers: Mapping[str, str],
                        timeout: float) -> Ack:
    """One JetStream publish awaiting its PubAck: ``js.publish`` at about two thirds of its CPU.

    The same wire exchange and the same errors (``APIError`` and its subclasses,
    ``NoStreamResponseError``, nats' ``TimeoutError``), with less around it: the
    reply comes through nats' own request inbox (``_resp_map``, as
    ``nc.request`` does), the deadline is one timer instead of ``wait_for``, and
    the PubAck is decoded by msgspec. The gateway issues six of these per
    binding moment, so this is a measurable share of its CPU (issue 8).
    """
    if not nc._resp_sub_prefix:
        await nc._init_request_sub()
    token = nc._nuid.next().decode()  # unique per connection, like nc.request's
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[object] = loop.create_future()
    nc._resp_map[token] = fut
    timer = loop.call_later(timeout, _expire, fut)
    try:
        await nc.publish(subject, payload, reply=nc._resp_sub_prefix.decode() + token, headers=dict(headers))
        msg = await fut
    finally:
        timer.cancel()
        nc._resp_map.pop(token, None)
    if msg.headers and msg.headers.get("Status") == "503":  # type: ignore[attr-defined]
        raise NoStreamResponseError
    ack = _ack_dec.decode(msg.data)  # type: ignore[attr-defined]
    if ack.error is not None:
        raise APIError.from_error(ack.error)
    return ack


async def enable_atomic(js: JetStreamContext, stream: str) -> bool:
    """Make sure ``stream`` allows atomic batches; False if it can't.

    An existing stream made without the flag gets it as an additive update,
    nothing replaced. A server that refuses it keeps the stream as it is, and
    its writers go one message at a time.
    """
    try:
        info = await js.stream_info(stream)
        if info.config.allow_atomic:
            return True
        cfg = info.config
        cfg.allow_atomic = True
        info = await js.update_stream(cfg)
    except (nats.errors.Error, TimeoutError) as e:  # APIError and NotFoundError included
        log.warning("stream takes no atomic batches; writing one message at a time",
                    stream=stream, error=str(e))
        return False
    # A server older than 2.12 drops the unknown field instead of refusing it.
    if info.config.allow_atomic:
        log.info("atomic batches enabled on an existing stream", stream=stream)
    return bool(info.config.allow_atomic)

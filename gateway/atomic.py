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

import json
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

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

"""Durable, idempotent publishing of everything the gateway emits.

Every publish goes to a JetStream stream, waits for the server's PubAck and
carries a deterministic ``Nats-Msg-Id``: a message redelivered after a crash
produces the same ids, and the stream drops the repeats. ``traceparent``
(W3C) rides along as a header on every message an input causes.

Group commit: publishes to one stream that are issued while an earlier
write to that stream is in flight are sent together as one JetStream atomic
batch (nats-server >= 2.12, stream ``allow_atomic``): stored whole or not at
all, answered by one PubAck, synced once under ``sync_interval: always``
instead of once per message. Each caller still returns only once its own
message is stored. A batch that the server refuses (a ``Nats-Msg-Id`` it
already holds, which is what a redelivery republishes; a stream without
``allow_atomic``; any other error) or that is not answered is re-sent one
message at a time, the plain way, so every message gets its own answer;
Msg-Id dedup makes the repeat of a batch that was in fact stored harmless.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.js import JetStreamContext

from gateway import metrics
from gateway.logs import get_logger
from subjects.names import Subjects
from subjects.wire import Outcome, SurfaceItem, Verdict

log = get_logger("pgw.publish")
_enc = msgspec.json.Encoder()

MAX_BATCH = 256  # messages per atomic batch (the server's limit is 1000)
ERR_ATOMIC_DISABLED = 10174  # the stream does not allow atomic publish


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict[str, Any] | None = None


_ack_dec = msgspec.json.Decoder(_PubAck)


@dataclass
class _Pending:
    subject: str
    body: bytes
    headers: dict[str, str]
    done: asyncio.Future[bool]


@dataclass
class _Stream:
    """Group commit for one stream: at most one write in flight, the rest wait and go together."""

    name: str
    atomic: bool | None = None  # None: not asked yet; False: the stream takes no atomic batches
    probe: asyncio.Future[None] | None = None
    queue: list[_Pending] = field(default_factory=list)
    busy: bool = False
    task: asyncio.Task[None] | None = None


class Publisher:
    def __init__(self, js: JetStreamContext, subjects: Subjects, *, timeout: float | None = None) -> None:
        self.js = js
        self.subjects = subjects
        self.timeout = timeout if timeout is not None else js._timeout
        self._streams = {name: _Stream(name) for name in ("PGW_OUTBOUND", "PGW_SURFACE", "PGW_VERDICTS")}

    async def _plain(self, subject: str, body: bytes, headers: dict[str, str]) -> bool:
        ack = await self.js.publish(subject, body, headers=headers, timeout=self.timeout)
        return not ack.duplicate

    async def _pub(self, stream: str, subject: str, body: bytes, msg_id: str, traceparent: str | None) -> bool:
        """Publish durably; True if the stream stored it, False if it was a duplicate."""
        headers = {"Nats-Msg-Id": msg_id}
        if traceparent:
            headers["traceparent"] = traceparent
        st = self._streams[stream]
        if st.atomic is None:
            await self._probe(st)
        if not st.atomic:
            return await self._plain(subject, body, headers)
        if not st.busy:
            # Nothing in flight to this stream: publish at once, the plain way;
            # what others queue meanwhile goes out together afterwards.
            st.busy = True
            try:
                return await self._plain(subject, body, headers)
            finally:
                self._next(st)
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        st.queue.append(_Pending(subject, body, headers, done))
        return await done

    async def _probe(self, st: _Stream) -> None:
        """Batch only where the stream says ``allow_atomic``: a server that does not know
        the flag drops it, and would store a batch's messages one by one without
        answering all but the last."""
        if st.probe is None:
            st.probe = asyncio.get_running_loop().create_future()
            try:
                info = await self.js.stream_info(st.name)
                st.atomic = bool(getattr(info.config, "allow_atomic", False))
            except Exception as e:  # noqa: BLE001 - no batching, plain publishes report their own errors
                log.warning("cannot read stream configuration; publishing one message at a time",
                            stream=st.name, error=str(e))
                st.atomic = False
            finally:
                st.probe.set_result(None)
        else:
            await st.probe

    def _next(self, st: _Stream) -> None:
        if st.queue:
            st.task = asyncio.get_running_loop().create_task(self._drain(st))
        else:
            st.busy = False

    async def _drain(self, st: _Stream) -> None:
        """Send what is queued for ``st``, one write at a time, until the queue is empty."""
        batch: list[_Pending] = []
        try:
            while st.queue:
                batch, st.queue = st.queue[:MAX_BATCH], st.queue[MAX_BATCH:]
                if len(batch) == 1 or not st.atomic:
                    await asyncio.gather(*(self._one(p) for p in batch))
                else:
                    await self._batch(st, batch)
        except BaseException as e:  # cancelled (shutdown): no caller may wait forever
            for p in [*batch, *st.queue]:
                if not p.done.done():
                    p.done.set_exception(e if isinstance(e, Exception) else asyncio.CancelledError())
            st.queue = []
            raise
        finally:
            st.busy = False
            st.task = None

    async def _one(self, p: _Pending) -> None:
        try:
            stored = await self._plain(p.subject, p.body, p.headers)
        except Exception as e:  # noqa: BLE001 - handed to the caller, who fails its turn
            if not p.done.done():
                p.done.set_exception(e)
            return
        if not p.done.done():
            p.done.set_result(stored)

    async def _batch(self, st: _Stream, batch: list[_Pending]) -> None:
        nc = self.js._nc
        batch_id = secrets.token_hex(11)
        last = len(batch) - 1
        try:
            for i, p in enumerate(batch):
                hdr = {**p.headers, "Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(i + 1)}
                if i < last:
                    await nc.publish(p.subject, p.body, headers=hdr)
                    continue
                hdr["Nats-Batch-Commit"] = "1"
                reply = await nc.request(p.subject, p.body, timeout=self.timeout, headers=hdr)
            ack = _ack_dec.decode(reply.data)
        except Exception as e:  # noqa: BLE001 - not answered: may or may not be stored
            log.warning("atomic batch not answered; re-sending one by one", stream=st.name, size=len(batch), error=str(e))
            await asyncio.gather(*(self._one(p) for p in batch))
            return
        if ack.error is not None:
            if ack.error.get("err_code") == ERR_ATOMIC_DISABLED:
                st.atomic = False
                log.warning("stream takes no atomic batches; publishing one message at a time", stream=st.name)
            # A duplicate Msg-Id (a redelivery) or any other refusal: nothing of
            # the batch was stored; each message gets its own answer.
            await asyncio.gather(*(self._one(p) for p in batch))
            return
        for p in batch:  # stored whole: no message in it was a duplicate
            if not p.done.done():
                p.done.set_result(True)

    async def outcome(self, outcome: Outcome, msg_id: str) -> None:
        await self._pub("PGW_OUTBOUND", self.subjects.outcome(outcome.agent), _enc.encode(outcome), msg_id,
                        outcome.traceparent)

    async def surface(self, item: SurfaceItem, msg_id: str) -> None:
        await self._pub("PGW_SURFACE", self.subjects.surface(item.principal), _enc.encode(item), msg_id,
                        item.traceparent)

    async def verdict(self, verdict: Verdict) -> None:
        stored = await self._pub(
            "PGW_VERDICTS",
            self.subjects.verdict(verdict.verdict_class),
            _enc.encode(verdict),
            verdict.verdict_id,
            verdict.traceparent,
        )
        if stored:  # every verdict counted once, whoever publishes it; repeats are not
            metrics.count_verdict(verdict.verdict_class)


__all__ = ["Publisher"]

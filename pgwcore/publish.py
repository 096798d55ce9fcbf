"""Durable, idempotent publishing of everything the gateway emits.

Every publish goes to a JetStream stream, waits for the server's PubAck and
carries a deterministic ``Nats-Msg-Id``: a message redelivered after a crash
produces the same ids, and the stream drops the repeats. ``traceparent``
(W3C) rides along as a header on every message an input causes.

Group commit (:class:`GroupCommit`): up to ``MAX_INFLIGHT`` writes to one
stream go out at once; writes issued while that many are in flight wait and
go together when one finishes. A queue of ``ATOMIC_MIN`` or more goes as one
JetStream atomic batch (nats-server >= 2.12, stream ``allow_atomic``): stored
whole or not at all, answered by one PubAck, synced once under
``sync_interval: always`` instead of once per message; a shorter queue goes
as plain writes, all at once, which costs less than a batch's fixed price. Each caller still
returns only once its own message is stored. A batch the server refuses (a
``Nats-Msg-Id`` it already holds, which is what a redelivery republishes; a
failed compare-and-set; a stream without ``allow_atomic``; anything else) or
does not answer is re-sent one message at a time, the plain way, so every
caller gets the answer a plain write would have had. The surface, verdict and
outcome publishes and the gateway's KV writes (:class:`KvWriter`: the
correlationId claim and its settle, the moment record) go through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyWrongLastSequenceError

from pgwcore import metrics
from pgwcore.atomic import ERR_ATOMIC_DISABLED, ERR_WRONG_LAST_SEQ, publish_acked, publish_atomic
from pgwcore.logs import get_logger
from subjects.names import Subjects
from subjects.wire import Outcome, SurfaceItem, Verdict

log = get_logger("pgw.publish")
_enc = msgspec.json.Encoder()

MAX_BATCH = 256  # messages per atomic batch (the server's limit is 1000)
# Writes in flight per stream. A nats-server 2.15 atomic batch stages its
# messages on disk before the commit: about 2.6 ms whatever its size, against
# 0.5 ms for one plain write (measured here, sync_interval always). So a few
# plain writes go out at once, and only a queue of ATOMIC_MIN or more goes as
# one batch. Against always-batching behind one write in flight: p50 at
# 500 envelopes/s 8-13 ms instead of 37-45 ms, throughput the same or better.
MAX_INFLIGHT = 4
ATOMIC_MIN = 16  # queued writes that go as one atomic batch; fewer go one by one, at once


@dataclass
class _Pending:
    subject: str
    body: bytes
    headers: dict[str, str]
    single: Callable[[], Awaitable[Any]]
    on_batch: Callable[[int], Any]
    done: asyncio.Future[Any]


class GroupCommit:
    """Group commit for one stream: at most MAX_INFLIGHT writes in flight, the rest wait and go together
    (as one atomic batch when there are ATOMIC_MIN of them or more)."""

    def __init__(
        self, js: JetStreamContext, stream: str, timeout: float | None = None, *, one_per_subject: bool = False
    ) -> None:
        self.js = js
        self.stream = stream
        self.one_per_subject = one_per_subject
        self.timeout = timeout if timeout is not None else js._timeout
        self.atomic: bool | None = None  # None: not asked yet; False: the stream takes no atomic batches
        self._probe_done: asyncio.Future[None] | None = None
        self._queue: list[_Pending] = []
        self._inflight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def write(
        self,
        subject: str,
        body: bytes,
        headers: dict[str, str],
        single: Callable[[], Awaitable[Any]],
        on_batch: Callable[[int], Any],
    ) -> Any:
        """Store one message; ``single()`` is the plain write and its result is returned, or,
        when the message went out in a batch stored whole, ``on_batch(its stream sequence)``."""
        if self.atomic is None:
            await self._probe()
        if not self.atomic:
            return await single()
        if self._inflight < MAX_INFLIGHT:
            # Room in flight: write at once, the plain way; what others queue
            # meanwhile goes out together afterwards.
            self._inflight += 1
            try:
                return await single()
            finally:
                self._next()
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(subject, body, headers, single, on_batch, done))
        return await done

    async def _probe(self) -> None:
        """Batch only where the stream says ``allow_atomic``: a server that does not know
        the flag drops it, and would store a batch's messages one by one without
        answering all but the last."""
        if self._probe_done is None:
            self._probe_done = asyncio.get_running_loop().create_future()
            try:
                info = await self.js.stream_info(self.stream)
                self.atomic = bool(getattr(info.config, "allow_atomic", False))
            except Exception as e:  # noqa: BLE001 - no batching; plain writes report their own errors
                log.warning("cannot read stream configuration; writing one message at a time",
                            stream=self.stream, error=str(e))
                self.atomic = False
            finally:
                self._probe_done.set_result(None)
        else:
            await self._probe_done

    def _next(self) -> None:
        """A write finished: its slot drains the queue, or is freed."""
        if self._queue:
            task = asyncio.get_running_loop().create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._inflight -= 1

    def _take(self) -> list[_Pending]:
        """The next batch: queue order, at most MAX_BATCH; with ``one_per_subject`` (KV writes)
        one message per subject, since a second compare-and-set on a key would fail
        the whole batch: it waits for the next one."""
        if not self.one_per_subject:
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            return batch
        batch = []
        rest: list[_Pending] = []
        subjects: set[str] = set()
        for p in self._queue:
            if len(batch) < MAX_BATCH and p.subject not in subjects:
                batch.append(p)
                subjects.add(p.subject)
            else:
                rest.append(p)
        self._queue = rest
        return batch

    async def _drain(self) -> None:
        """Send what is queued, one write at a time, until the queue is empty."""
        batch: list[_Pending] = []
        try:
            while self._queue:
                batch = self._take()
                if len(batch) < ATOMIC_MIN or not self.atomic:
                    await asyncio.gather(*(self._one(p) for p in batch))
                else:
                    await self._batch(batch)
        except BaseException as e:  # cancelled (shutdown): no caller may wait forever
            for p in [*batch, *self._queue]:
                if not p.done.done():
                    p.done.set_exception(e if isinstance(e, Exception) else asyncio.CancelledError())
            self._queue = []
            raise
        finally:
            self._inflight -= 1

    @staticmethod
    async def _one(p: _Pending) -> None:
        try:
            result = await p.single()
        except Exception as e:  # noqa: BLE001 - handed to the caller, who fails its turn
            if not p.done.done():
                p.done.set_exception(e)
            return
        if not p.done.done():
            p.done.set_result(result)

    async def _batch(self, batch: list[_Pending]) -> None:
        try:
            ack = await publish_atomic(self.js._nc, [(p.subject, p.body, p.headers) for p in batch],
                                       timeout=self.timeout)
        except APIError as e:
            if e.err_code == ERR_ATOMIC_DISABLED:
                self.atomic = False
                log.warning("stream takes no atomic batches; writing one message at a time", stream=self.stream)
            # A duplicate Msg-Id (a redelivery), a failed compare-and-set or any
            # other refusal: nothing of the batch was stored; one by one, each
            # message gets its own answer.
            await asyncio.gather(*(self._one(p) for p in batch))
            return
        except Exception as e:  # noqa: BLE001 - not answered: may or may not be stored
            log.warning("atomic batch not answered; re-sending one by one", stream=self.stream, size=len(batch),
                        error=str(e))
            await asyncio.gather(*(self._one(p) for p in batch))
            return
        if ack.batch_size != len(batch):  # cannot happen for a committed batch; never guess
            await asyncio.gather(*(self._one(p) for p in batch))
            return
        # Stored whole, contiguously, the commit last: no message in it was a duplicate.
        first = ack.seq - (len(batch) - 1)
        for i, p in enumerate(batch):
            if not p.done.done():
                p.done.set_result(p.on_batch(first + i))


def _stored(_seq: int) -> bool:
    return True


def _revision(seq: int) -> int:
    return seq


class KvWriter:
    """``kv.create`` / ``kv.update`` of one bucket through a :class:`GroupCommit`.

    The same results (the new revision) and errors (``KeyWrongLastSequenceError``)
    as nats' KeyValue, which does every write the batch does not (and the
    re-create of a deleted key).
    """

    def __init__(self, js: JetStreamContext, kv: Any, bucket: str) -> None:
        self.js = js
        self.kv = kv
        self._pre = f"$KV.{bucket}."
        self._gc = GroupCommit(js, f"KV_{bucket}", one_per_subject=True)

    async def _put(self, key: str, value: bytes, last: int, extra: dict[str, str] | None = None) -> int:
        """``kv.update(key, value, last=last)`` (last 0: the key must not exist) through
        ``publish_acked``: the same revision, or ``KeyWrongLastSequenceError``. ``extra``:
        headers stored with the value (a KV read ignores them; a watcher may read only them)."""
        try:
            ack = await publish_acked(self.js._nc, self._pre + key, value,
                                      self._headers(last, extra), self.js._timeout)
        except APIError as e:
            if e.err_code == ERR_WRONG_LAST_SEQ:
                raise KeyWrongLastSequenceError(description=e.description) from None
            raise
        return ack.seq

    @staticmethod
    def _headers(last: int, extra: dict[str, str] | None) -> dict[str, str]:
        return {"Nats-Expected-Last-Subject-Sequence": str(last), **(extra or {})}

    async def _create(self, key: str, value: bytes, extra: dict[str, str] | None) -> int:
        try:
            return await self._put(key, value, 0, extra)
        except KeyWrongLastSequenceError:
            # Taken, or a delete/purge marker nats' create writes over: let it decide
            # (without ``extra``: a watcher then reads the value itself).
            return await self.kv.create(key, value)

    async def create(self, key: str, value: bytes, headers: dict[str, str] | None = None) -> int:
        return await self._gc.write(
            self._pre + key, value, self._headers(0, headers),
            lambda: self._create(key, value, headers), _revision,
        )

    async def update(self, key: str, value: bytes, last: int, headers: dict[str, str] | None = None) -> int:
        return await self._gc.write(
            self._pre + key, value, self._headers(last, headers),
            lambda: self._put(key, value, last, headers), _revision,
        )


DELETE_MARKER = {"KV-Operation": "DEL"}  # the header of nats' KeyValue.delete marker


async def kv_delete(js: JetStreamContext, bucket: str, key: str) -> int:
    """``kv.delete(key)`` of ``bucket``: the same delete marker (an empty value with
    ``KV-Operation: DEL``; a read then raises ``KeyNotFoundError``, a watcher sees a delete),
    through ``publish_acked`` instead of the KV client's request path. The marker's stream sequence."""
    ack = await publish_acked(js._nc, f"$KV.{bucket}.{key}", b"", DELETE_MARKER, js._timeout)
    return ack.seq


class Publisher:
    def __init__(self, js: JetStreamContext, subjects: Subjects, *, timeout: float | None = None) -> None:
        self.js = js
        self.subjects = subjects
        self.timeout = timeout if timeout is not None else js._timeout
        self._streams = {name: GroupCommit(js, name, self.timeout) for name in ("PGW_OUTBOUND", "PGW_SURFACE", "PGW_VERDICTS")}
        # SR-1 (spec 002) over every verdict, whoever publishes it: set by the gateway, which holds the
        # redactor. A verdict becomes a capsule (spec 004), anchored for good: no secret may reach it.
        # It returns the verdict to publish and its JSON text (encoded once, by the scrub's check).
        self.scrub_verdict: Callable[[Verdict], Awaitable[tuple[Verdict, bytes]]] | None = None

    async def _plain(self, subject: str, body: bytes, headers: dict[str, str]) -> bool:
        ack = await publish_acked(self.js._nc, subject, body, headers, self.timeout)
        return not ack.duplicate

    async def _pub(self, stream: str, subject: str, body: bytes, msg_id: str, traceparent: str | None) -> bool:
        """Publish durably; True if the stream stored it, False if it was a duplicate."""
        headers = {"Nats-Msg-Id": msg_id}
        if traceparent:
            headers["traceparent"] = traceparent
        return await self._streams[stream].write(
            subject, body, headers, lambda: self._plain(subject, body, headers), _stored,
        )

    async def outcome(self, outcome: Outcome, msg_id: str, body: bytes | None = None) -> None:
        """Publish ``outcome``; ``body``: its JSON text when the caller has it already."""
        await self._pub("PGW_OUTBOUND", self.subjects.outcome(outcome.agent),
                        _enc.encode(outcome) if body is None else body, msg_id, outcome.traceparent)

    async def surface(self, item: SurfaceItem, msg_id: str) -> None:
        await self._pub("PGW_SURFACE", self.subjects.surface(item.principal), _enc.encode(item), msg_id,
                        item.traceparent)

    async def verdict(self, verdict: Verdict) -> None:
        if self.scrub_verdict is not None:
            verdict, body = await self.scrub_verdict(verdict)
        else:
            body = _enc.encode(verdict)
        stored = await self._pub(
            "PGW_VERDICTS",
            self.subjects.verdict(verdict.verdict_class),
            body,
            verdict.verdict_id,
            verdict.traceparent,
        )
        if stored:  # every verdict counted once, whoever publishes it; repeats are not
            metrics.count_verdict(verdict.verdict_class)


__all__ = ["DELETE_MARKER", "GroupCommit", "KvWriter", "Publisher"]

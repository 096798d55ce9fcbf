"""What the notifier keeps on the bus: push subscriptions, notification jobs, dead letters.

- ``PGW_PUSH_SUBS`` (KV): one key per subscription, ``{P}.{id}``, ``id`` =
  the first 32 hex digits of SHA-256 over the endpoint URL (stable: the same
  endpoint subscribed twice is one entry).
- ``PGW_NOTIFY`` (KV): one job per moment, kind and channel,
  ``{P}.{moment_id}.{kind}.{channel}``; ``kind`` is ``first`` or ``reminder``,
  ``channel`` is ``email``, ``webhook`` or ``push-{id}``. The job is the
  "one notification per moment per channel" record: it is created with
  ``create`` (a redelivered surface item finds it and adds nothing) and moves
  ``scheduled`` -> ``sending`` -> ``sent`` (or ``suppressed``, ``skipped``,
  ``dropped``, ``dead``) by compare-and-set.
- ``PGW_NOTIFY_DLQ`` (stream, ``{prefix}.notify.deadletter``): jobs given up
  on, with the last error (``pgw notifications dead``).

Records the notifier did not write. A bucket's keys and a stream's subjects
can receive a value no service wrote: nats-server sends its publish
acknowledgement (``{"stream": "PGW_INBOUND", "seq": N}``) to whatever reply
subject an agent names on its own envelope publish, and a bucket or stream
capturing that subject stores it (docs/security.md "Replies"). Every read here
takes a value only if it decodes as the record the notifier writes *and* sits
under the key that record names; anything else is skipped, with one warning
per key and revision naming the key, never the value (:func:`foreign`). So a
junk key under ``PGW_PUSH_SUBS.{P}.`` costs P no channel, and a junk key in
``PGW_NOTIFY`` costs no start its resumed jobs. A job or subscription key that
holds such a value is written over when the notifier writes that key again
(:meth:`Store.create_job` takes the key by compare-and-set).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Literal

import msgspec
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import KeyNotFoundError, NotFoundError

from pgwcore.kvread import kv_keys
from pgwcore.logs import get_logger
from pgwcore.msgget import stored_range
from pgwcore.streams import ensure_kv, ensure_stream
from subjects.names import Subjects

log = get_logger("pgw.notifier")

SUBS_BUCKET = "PGW_PUSH_SUBS"
JOBS_BUCKET = "PGW_NOTIFY"
DLQ_STREAM = "PGW_NOTIFY_DLQ"
JOBS_TTL_S = 35 * 86400.0  # longer than PGW_SURFACE keeps an item (30 days): a redelivery finds its job

JobStatus = Literal["scheduled", "sending", "sent", "suppressed", "skipped", "dropped", "dead"]
OPEN: tuple[str, ...] = ("scheduled", "sending")


class PushSubscription(msgspec.Struct, omit_defaults=True):
    """A browser's PushSubscription (W3C Push API ``toJSON()``), as stored."""

    endpoint: str
    p256dh: str  # base64url, 65-byte uncompressed P-256 point (RFC 8291 §3.1 ua_public)
    auth: str  # base64url, 16-byte auth secret (RFC 8291 §3.2)
    device: str | None = None
    expiration_time: float | None = None
    created_at: float = 0.0


class Job(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One notification to send: a moment, a kind (first or reminder), a channel."""

    principal: str
    moment_id: str
    agent: str
    kind: Literal["first", "reminder"]
    channel: str
    item: Literal["binding_moment", "clarification"] = "binding_moment"
    due: float
    expires_at: float | None = None
    synopsis: str | None = None  # only when the principal opted in; from the redacted surface item
    untrusted: bool = False
    # The surface item as the gateway sent it (already redacted), kept only for the e-mail job of a
    # principal with answer_by_email: the mail renders the whole moment (consumers/notify/answers.py).
    surface_item: str | None = None
    status: JobStatus = "scheduled"
    attempts: int = 0
    last_error: str | None = None
    created_at: float = 0.0
    sent_at: float | None = None

    @property
    def key(self) -> str:
        return job_key(self.principal, self.moment_id, self.kind, self.channel)

    @property
    def notification_id(self) -> str:
        """Stable per moment, kind and channel: a repeat after a crash carries the same id."""
        return hashlib.sha256(self.key.encode()).hexdigest()[:32]


class DeadLetter(msgspec.Struct, omit_defaults=True):
    job: Job
    reason: str
    ts: float


def subscription_id(endpoint: str) -> str:
    return hashlib.sha256(endpoint.encode()).hexdigest()[:32]


def job_key(principal: str, moment_id: str, kind: str, channel: str) -> str:
    return f"{principal}.{moment_id}.{kind}.{channel}"


enc = msgspec.json.Encoder()
job_dec = msgspec.json.Decoder(Job)
sub_dec = msgspec.json.Decoder(PushSubscription)

_WARNED_MOST = 10_000
_warned: dict[tuple[str, str, int], None] = {}  # (store, key, revision) already logged by this process


def foreign(store: str, key: str, revision: int) -> None:
    """Log a stored value the notifier did not write, once per key and revision; the caller skips it.

    The value itself is never logged: it is not ours, and may be anything a subject can carry."""
    mark = (store, key, revision)
    if mark in _warned:
        return
    _warned[mark] = None
    if len(_warned) > _WARNED_MOST:
        _warned.pop(next(iter(_warned)))
    log.warning("a stored value the notifier did not write; skipped", store=store, key=key[:200], revision=revision)


def decode_job(key: str, value: bytes, revision: int) -> Job | None:
    """The job stored under ``key``, or None (logged) for a value that is no job of that key."""
    try:
        job = job_dec.decode(value)
    except msgspec.DecodeError:  # a ValidationError is one
        job = None
    if job is None or job.key != key:
        foreign(JOBS_BUCKET, key, revision)
        return None
    return job


def decode_subscription(key: str, value: bytes, revision: int) -> PushSubscription | None:
    """The subscription stored under ``key`` (``{P}.{id}``), or None (logged) for a value that is not one."""
    try:
        sub = sub_dec.decode(value)
    except msgspec.DecodeError:  # a ValidationError is one
        sub = None
    if sub is None or key.split(".", 1)[-1] != subscription_id(sub.endpoint):
        foreign(SUBS_BUCKET, key, revision)
        return None
    return sub


class Store:
    """The notifier's buckets and dead-letter stream."""

    def __init__(self, js: JetStreamContext, subjects: Subjects) -> None:
        self.js = js
        self.subjects = subjects
        self.subs: Any = None
        self.jobs: Any = None

    async def open(self) -> Store:
        self.subs = await ensure_kv(self.js, SUBS_BUCKET)
        self.jobs = await ensure_kv(self.js, JOBS_BUCKET, ttl=JOBS_TTL_S)
        await ensure_stream(self.js, StreamConfig(
            name=DLQ_STREAM, subjects=[self.subjects.notify_deadletter], storage=StorageType.FILE,
            retention=RetentionPolicy.LIMITS, max_age=90 * 86400.0))
        return self

    async def _keys(self, bucket: str, prefix: str) -> list[str]:
        """Keys under ``prefix`` from the server's per-subject index (``pgwcore.kvread.kv_keys``)."""
        return await kv_keys(self.js, bucket, f"{prefix}>")

    # -- push subscriptions ---------------------------------------------------
    async def put_subscription(self, principal: str, sub: PushSubscription) -> str:
        sid = subscription_id(sub.endpoint)
        await self.subs.put(f"{principal}.{sid}", enc.encode(sub))
        return sid

    async def delete_subscription(self, principal: str, sid: str) -> bool:
        try:
            entry = await self.subs.get(f"{principal}.{sid}")
        except KeyNotFoundError:
            return False
        if entry.value is None:
            return False
        await self.subs.delete(f"{principal}.{sid}")
        return True

    async def subscriptions(self, principal: str) -> dict[str, PushSubscription]:
        out: dict[str, PushSubscription] = {}
        for key in await self._keys(SUBS_BUCKET, f"{principal}."):
            try:
                entry = await self.subs.get(key)
            except KeyNotFoundError:
                continue
            if entry.value and (sub := decode_subscription(key, entry.value, entry.revision)) is not None:
                out[key.split(".", 1)[1]] = sub
        return out

    async def subscription(self, principal: str, sid: str) -> PushSubscription | None:
        key = f"{principal}.{sid}"
        try:
            entry = await self.subs.get(key)
        except KeyNotFoundError:
            return None
        return decode_subscription(key, entry.value, entry.revision) if entry.value else None

    # -- jobs -----------------------------------------------------------------
    async def create_job(self, job: Job) -> bool:
        """Record a job once; False if it exists already (a redelivered item).

        A key holding a value the notifier did not write is no job: it is taken by compare-and-set
        on that value's revision, so the job is written once all the same."""
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            await self.jobs.create(job.key, enc.encode(job))
        except KeyWrongLastSequenceError:
            pass
        else:
            return True
        try:
            entry = await self.jobs.get(job.key)
        except KeyNotFoundError:
            return False  # gone since (its TTL): the item is acked with its jobs made once already
        if not entry.value or decode_job(job.key, entry.value, entry.revision) is not None:
            return False
        try:
            await self.jobs.update(job.key, enc.encode(job), last=entry.revision)
        except KeyWrongLastSequenceError:
            return False  # another notifier wrote it first
        return True

    async def get_job(self, key: str) -> tuple[Job, int] | None:
        try:
            entry = await self.jobs.get(key)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        job = decode_job(key, entry.value, entry.revision)
        return None if job is None else (job, entry.revision)

    async def update_job(self, job: Job, revision: int) -> int | None:
        """Compare-and-set; None if someone else changed the job first."""
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            return await self.jobs.update(job.key, enc.encode(job), last=revision)
        except KeyWrongLastSequenceError:
            return None

    async def job_keys(self) -> list[str]:
        return await self._keys(JOBS_BUCKET, "")

    async def dead_letter(self, job: Job, reason: str) -> None:
        record = DeadLetter(job, reason, time.time())
        await self.js.publish(self.subjects.notify_deadletter, enc.encode(record),
                              headers={"Nats-Msg-Id": f"notify-dlq:{job.key}"})


class Status(msgspec.Struct):
    """``pgw notifications``: jobs by status, subscriptions, dead letters (read from the bus)."""

    jobs: dict[str, int]
    push_subscriptions: int
    dead_letters: int


async def status(js: JetStreamContext, subjects: Subjects) -> Status:
    from nats.js.errors import BucketNotFoundError

    counts: dict[str, int] = {}
    store = Store(js, subjects)
    try:
        store.jobs = await js.key_value(JOBS_BUCKET)
        for key in await store.job_keys():
            got = await store.get_job(key)
            if got:
                counts[got[0].status] = counts.get(got[0].status, 0) + 1
    except BucketNotFoundError:
        pass
    subs = 0
    try:
        store.subs = await js.key_value(SUBS_BUCKET)
        for key in await store._keys(SUBS_BUCKET, ""):
            principal, _, sid = key.partition(".")
            if await store.subscription(principal, sid) is not None:
                subs += 1
    except BucketNotFoundError:
        pass
    try:
        dead = (await js.stream_info(DLQ_STREAM)).state.messages
    except NotFoundError:
        dead = 0
    return Status(counts, subs, dead)


async def dead_letters(js: JetStreamContext, limit: int = 100) -> list[DeadLetter]:
    """The newest ``limit`` dead letters, oldest first (message get: works for ops users too)."""
    try:
        state = (await js.stream_info(DLQ_STREAM)).state
    except NotFoundError:
        return []
    dec = msgspec.json.Decoder(DeadLetter)
    first = max(state.first_seq, state.last_seq - limit + 1)
    out: list[DeadLetter] = []
    async for m in stored_range(js, DLQ_STREAM, first, state.last_seq):
        if not m.data:
            continue
        try:
            out.append(dec.decode(m.data))
        except msgspec.DecodeError:  # a ValidationError is one
            foreign(DLQ_STREAM, m.subject, m.seq)
    return out

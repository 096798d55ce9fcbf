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
from pgwcore.msgget import stored_range
from pgwcore.streams import ensure_kv, ensure_stream
from subjects.names import Subjects

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
            if entry.value:
                out[key.split(".", 1)[1]] = sub_dec.decode(entry.value)
        return out

    async def subscription(self, principal: str, sid: str) -> PushSubscription | None:
        try:
            entry = await self.subs.get(f"{principal}.{sid}")
        except KeyNotFoundError:
            return None
        return sub_dec.decode(entry.value) if entry.value else None

    # -- jobs -----------------------------------------------------------------
    async def create_job(self, job: Job) -> bool:
        """Record a job once; False if it exists already (a redelivered item)."""
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            await self.jobs.create(job.key, enc.encode(job))
        except KeyWrongLastSequenceError:
            return False
        return True

    async def get_job(self, key: str) -> tuple[Job, int] | None:
        try:
            entry = await self.jobs.get(key)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        return job_dec.decode(entry.value), entry.revision

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
    subs = len(await store._keys(SUBS_BUCKET, ""))
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
    return [dec.decode(m.data) async for m in stored_range(js, DLQ_STREAM, first, state.last_seq) if m.data]

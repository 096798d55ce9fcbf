"""``pgw notifier``: follow the principals' surface stream and notify through each channel.

Flow (docs/notifications.md "Guarantees"):

1. A durable pull consumer (``notifier.durable``) on ``PGW_SURFACE`` reads every
   surface item the gateway sends, already redacted. For a binding moment or a
   clarification it writes one job per channel of the principal (and a reminder
   job if configured) to ``PGW_NOTIFY`` with ``create``, *then* acks the item:
   a crash before the ack redelivers the item and ``create`` adds nothing twice.
2. A scheduler runs due jobs. Before sending it asks ``PGW_MOMENTS`` whether
   the moment still waits (answered, withdrawn or expired: ``skipped``),
   whether a surface of the principal is present (``suppressed``) and whether
   it is quiet time for the principal (the job waits for the end).
3. The job is set ``sending`` by compare-and-set, sent, then set ``sent``. A
   transient failure sets it back to ``scheduled`` with exponential back-off;
   after ``notifier.max_attempts`` tries, or at once for a permanent refusal,
   it goes to the dead-letter stream and becomes ``dead``. A push service's
   404/410 drops that subscription (``dropped``).

Guarantee: at least once per moment, kind and channel; exactly once unless the
process dies during a send. A job found ``sending`` at start (the notifier died
while sending it) is sent again: only those jobs (at most ``concurrency`` of
them) can be repeated, once per crash. The repeat carries the same id (webhook
``Pgw-Notification-Id``, mail ``Message-ID``, push ``Topic`` and notification
``tag``), so receivers and devices collapse it. Two notifier instances never
send one job twice while both live (compare-and-set on ``sending``).

The notifier is its own consumer: a slow or dead channel never holds the gateway.

What it reads may hold records no service wrote (the server's publish
acknowledgement, aimed by an agent at a bucket key or stream subject:
docs/security.md "Replies"): a surface message that is no surface item of a
valid principal, a ``PGW_MOMENTS`` value that is no moment record and every
foreign value of its own buckets (consumers/notify/store.py) are skipped with
one warning naming the key; none stops a principal's notifications or a start.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from consumers.notify import metrics
from consumers.notify.answers import AnswerLinks
from consumers.notify.channels import Mailer, Notice, read_secret, render, send_webhook
from consumers.notify.quiet import quiet_until
from consumers.notify.responders import Presence, Responders
from consumers.notify.store import OPEN, Job, Store, foreign
from consumers.notify.vapid import load_or_create_vapid_key
from consumers.notify.webpush import PushResult
from consumers.notify.webpush import send as push_send
from pgwcore.logs import get_logger
from pgwcore.service import PullService
from subjects.errors import SubjectError
from subjects.names import check_token
from subjects.util import parse_rfc3339
from subjects.wire import BindingMomentItem, ClarificationItem, WithdrawnItem, surface_item_decoder

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from pgwcore.config import Config
    from pgwcore.notifier_config import PrincipalNotify

log = get_logger("pgw.notifier")
SURFACE_STREAM = "PGW_SURFACE"
MOMENTS_BUCKET = "PGW_MOMENTS"


class _MomentState(msgspec.Struct):
    """What the notifier reads of the gateway's moment record (gateway/moment_record.py): the fields every
    record has are required, so a value the gateway did not write is told apart. ``status`` is left out
    of the record while ``pending`` (``omit_defaults``)."""

    moment_id: str
    principal: str
    status: str = "pending"
    expires_at: float | None = None


_moment_dec = msgspec.json.Decoder(_MomentState)


class Notifier(PullService):
    """The notifier service; its life cycle (start, idempotent ``drain()``, close) is ``PullService``'s."""

    name = "notifier"

    def __init__(self, config: Config, nc: Client) -> None:
        super().__init__(config, nc)
        self.cfg = config.notifier
        self.presence = Presence()
        self.store = Store(self.js, self.subjects)
        s = config.surfaces
        self.surface_url = self.cfg.surface_url or f"http://{s.web_host}:{s.web_port}/"
        # Files the configuration names are read now: a bad one stops the start, with its path.
        self.mailer = Mailer(self.cfg.smtp) if self.cfg.smtp.host else None
        self.secrets = {name: read_secret(p.webhook_secret_file, f"notifier.principals.{name}.webhook_secret_file")
                        for name, p in self.cfg.principals.items() if p.webhook_secret_file}
        self.vapid = load_or_create_vapid_key(config.data_path, create=config.keys.create,
                                              keys_dir=config.keys_path)
        self.responders: Responders | None = None
        # E-mail answers (consumers/notify/answers.py): only when a principal opted in and mail is set up.
        self.answers: AnswerLinks | None = None
        if self.mailer and any(p.answer_by_email for p in self.cfg.principals.values()):
            self.answers = AnswerLinks(config, nc, self.js)
        self.http: aiohttp.ClientSession | None = None
        self._moments: Any = None
        self._wake = asyncio.Event()
        self._heap: list[tuple[float, str]] = []
        self._inflight: set[str] = set()
        self._running: set[asyncio.Task[None]] = set()
        self._closed: dict[str, None] = {}  # moments withdrawn (bounded; PGW_MOMENTS is the authority)
        self._sem = asyncio.Semaphore(self.cfg.concurrency)
        self._started = 0.0
        self.counts: dict[str, int] = {}

    async def start(self) -> None:
        await self.store.open()
        self.http = aiohttp.ClientSession()
        self.responders = Responders(self.nc, self.subjects.prefix, self.cfg, self.store, self.vapid, self.presence)
        await self.responders.start()
        if self.answers is not None:
            await self.answers.start()
        self._started = time.time()
        self._sub = await self.js.pull_subscribe(
            self.subjects.all_principals("surface"), durable=self.cfg.durable, stream=SURFACE_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0, max_deliver=-1,
                                  deliver_policy=DeliverPolicy.ALL))
        self.spawn(self._feed(), name="pgw-notifier-feed")
        self.spawn(self._schedule_loop(), name="pgw-notifier-scheduler")
        log.info("notifier started", vapid_public_key=self.vapid.public_b64url, surface_url=self.surface_url,
                 email=bool(self.mailer), principals=sorted(self.cfg.principals))

    async def stop_inputs(self) -> None:
        """Push and presence responders stop; the scheduler wakes to see ``stopping``."""
        if self.responders is not None:
            await self.responders.stop()
        self._wake.set()

    async def close(self) -> None:
        """Once reading and scheduling have stopped (``drain()``): let sends in flight finish, close HTTP."""
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        http, self.http = self.http, None
        if http is not None:
            await http.close()
        if self.answers is not None:
            await self.answers.close()

    # -- reading the surface stream ---------------------------------------------
    async def _feed(self) -> None:
        while not self.stopping.is_set():
            msgs = await self.fetch(lambda: self._sub.fetch(64, timeout=0.5), log)
            if msgs is None:
                return
            for msg in msgs:
                try:
                    await self.on_item(msg)
                except Exception:
                    log.exception("surface item not handled; redelivered later", subject=msg.subject)
                    with contextlib.suppress(Exception):
                        await msg.nak(delay=2.0)
                    continue
                await msg.ack()

    async def on_item(self, msg: Msg) -> None:
        try:
            principal = check_token(msg.subject.split(".")[len(self.subjects.prefix.split(".")) + 1],
                                    "principal token")
            item = surface_item_decoder.decode(msg.data)
        except (SubjectError, msgspec.DecodeError, UnicodeDecodeError):
            # Not the gateway's: no principal or no item (a publish acknowledgement aimed here); acked.
            foreign(SURFACE_STREAM, msg.subject, msg.metadata.sequence.stream)
            return
        if isinstance(item, WithdrawnItem):
            self._closed[item.moment_id] = None
            if len(self._closed) > 50_000:
                self._closed.pop(next(iter(self._closed)))
            return
        if not isinstance(item, BindingMomentItem | ClarificationItem):
            return
        pc = self.cfg.for_principal(principal)
        now = time.time()
        expires = parse_rfc3339(item.expires_at).timestamp() if item.expires_at else None
        if not await self._waits(principal, item.moment_id, expires, now):
            return  # answered, withdrawn or expired already (e.g. history read at a first start): no job
        synopsis = None
        if pc.show_synopsis and isinstance(item, BindingMomentItem):
            synopsis = item.binding_moment.synopsis  # as redacted on the surface item (SR-1)
        base = {"principal": principal, "moment_id": item.moment_id, "agent": item.agent, "expires_at": expires,
                "item": "clarification" if isinstance(item, ClarificationItem) else "binding_moment",
                "synopsis": synopsis, "untrusted": item.untrusted, "created_at": now}
        kinds: list[tuple[str, float]] = [("first", now)]
        if pc.reminder_before_s and expires is not None and expires - pc.reminder_before_s > now:
            kinds.append(("reminder", expires - pc.reminder_before_s))
        for channel in await self._channels(principal, pc):
            extra = {"surface_item": msg.data.decode()} if channel == "email" and pc.answer_by_email else {}
            for kind, due in kinds:
                job = Job(kind=kind, channel=channel, due=due, **base, **extra)  # type: ignore[arg-type]
                if await self.store.create_job(job):
                    self._schedule(job.key, due)

    async def _channels(self, principal: str, pc: PrincipalNotify) -> list[str]:
        out: list[str] = []
        if pc.email and self.mailer:
            out.append("email")
        if pc.webhook_url:
            out.append("webhook")
        if pc.web_push:
            out += [f"push-{sid}" for sid in sorted(await self.store.subscriptions(principal))]
        return out

    # -- scheduling -------------------------------------------------------------
    def _schedule(self, key: str, due: float) -> None:
        heapq.heappush(self._heap, (due, key))
        self._wake.set()

    async def _load_open_jobs(self) -> None:
        """Jobs left scheduled or sending by an earlier run (``sending``: sent again, at least once)."""
        n = 0
        for key in await self.store.job_keys():
            if self.stopping.is_set():
                return
            got = await self.store.get_job(key)
            if got and got[0].status in OPEN:
                self._schedule(key, got[0].due)
                n += 1
        if n:
            log.info("notification jobs of an earlier run resumed", jobs=n)

    async def _schedule_loop(self) -> None:
        # In the background, so that a long history never delays the start of `pgw up`.
        try:
            await self._load_open_jobs()
        except Exception:
            log.exception("resuming earlier jobs failed; they run at the next start")
        while not self.stopping.is_set():
            now = time.time()
            while self._heap and self._heap[0][0] <= now:
                _, key = heapq.heappop(self._heap)
                if key in self._inflight:
                    continue
                self._inflight.add(key)
                task = asyncio.create_task(self._run_guarded(key))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
            metrics.SCHEDULED.set(len(self._heap))
            metrics.PRESENT.set(self.presence.count())
            wait = min(1.0, self._heap[0][0] - now) if self._heap else 1.0
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(wait, 0.01))

    async def _run_guarded(self, key: str) -> None:
        try:
            async with self._sem:
                if not self.stopping.is_set():
                    await self.run_job(key)
        except Exception:
            log.exception("notification job failed; retried shortly", job=key)
            self._schedule(key, time.time() + self.cfg.backoff_base_s)
        finally:
            self._inflight.discard(key)

    async def _still_waiting(self, job: Job, now: float) -> bool:
        return await self._waits(job.principal, job.moment_id, job.expires_at, now)

    async def _waits(self, principal: str, moment_id: str, expires_at: float | None, now: float) -> bool:
        """Does the moment still wait for an answer? (The gateway's record is the authority.)"""
        if moment_id in self._closed or (expires_at is not None and expires_at <= now):
            return False
        if self._moments is None:
            try:  # the gateway's bucket (never created here: the gateway owns its TTL and settings)
                self._moments = await self.js.key_value(MOMENTS_BUCKET)
            except BucketNotFoundError:
                return False  # no gateway has ever run: no moment can wait
        try:
            entry = await self._moments.get(f"{principal}.{moment_id}")
        except KeyNotFoundError:
            return False
        if not entry.value:
            return False
        try:
            state = _moment_dec.decode(entry.value)
        except msgspec.DecodeError:  # a ValidationError is one
            state = None
        if state is None or (state.principal, state.moment_id) != (principal, moment_id):
            foreign(MOMENTS_BUCKET, f"{principal}.{moment_id}", entry.revision)
            return False  # no record of the gateway's: no moment that waits, as for a key with none
        return state.status == "pending" and not (state.expires_at and state.expires_at <= now)

    async def _finish(self, job: Job, rev: int, status: str, error: str | None = None) -> None:
        job.status = status  # type: ignore[assignment]
        job.last_error = error
        if status == "sent":
            job.sent_at = time.time()
        await self.store.update_job(job, rev)
        kind = job.channel.split("-", 1)[0]
        metrics.NOTIFICATIONS.labels(kind, status).inc()
        self.counts[status] = self.counts.get(status, 0) + 1

    async def run_job(self, key: str) -> None:
        got = await self.store.get_job(key)
        if got is None or got[0].status not in OPEN:
            return
        job, rev = got
        now = time.time()
        if job.due > now + 0.05:  # an earlier heap entry of a job since moved (retry, quiet hours)
            self._schedule(key, job.due)
            return
        if not await self._still_waiting(job, now):
            await self._finish(job, rev, "skipped", "the moment no longer waits (answered, withdrawn or expired)")
            return
        grace_end = self._started + self.cfg.presence_grace_s
        if now < grace_end:  # a restarted notifier first hears who is present (docs/notifications.md)
            self._schedule(key, grace_end)
            return
        if self.presence.present(job.principal):
            await self._finish(job, rev, "suppressed", "a surface of the principal was open")
            return
        pc = self.cfg.for_principal(job.principal)
        until = quiet_until(pc, now)
        if until is not None:
            if job.kind == "reminder" and job.expires_at is not None and until >= job.expires_at:
                await self._finish(job, rev, "skipped", "quiet hours last until the moment expires")
                return
            job.due = until
            if await self.store.update_job(job, rev) is not None:
                self._schedule(key, until)
            return
        job.status, job.attempts = "sending", job.attempts + 1
        rev2 = await self.store.update_job(job, rev)
        if rev2 is None:
            return  # another notifier took it
        result = await self._send(job, pc)
        await self._settle(job, rev2, result)

    async def _send(self, job: Job, pc: PrincipalNotify) -> PushResult:
        assert self.http is not None
        notice: Notice = render(job, pc, self.surface_url)
        if job.channel == "email":
            if not self.mailer or not pc.email:
                return PushResult("failed", None, "e-mail is no longer configured for this principal")
            answer = None
            if pc.answer_by_email and self.answers is not None and job.surface_item:
                answer = self.answers.mail(job.principal, job.surface_item, job.expires_at)
            return await self.mailer.send(job, notice, pc.email, answer)
        if job.channel == "webhook":
            secret = self.secrets.get(job.principal)
            if not pc.webhook_url or secret is None:
                return PushResult("failed", None, "the webhook is no longer configured for this principal")
            return await send_webhook(self.http, pc.webhook_url, secret, job, notice, pc,
                                      timeout_s=self.cfg.http_timeout_s, now=int(time.time()))
        sid = job.channel.removeprefix("push-")
        sub = await self.store.subscription(job.principal, sid)
        if sub is None:
            return PushResult("gone", None, "the subscription was removed")
        return await push_send(self.http, endpoint=sub.endpoint, p256dh=sub.p256dh, auth=sub.auth,
                               payload=notice.push_payload(), vapid=self.vapid, subject=self.cfg.vapid_subject,
                               ttl_s=self.cfg.push_ttl_s, topic=job.moment_id[:32],
                               timeout_s=self.cfg.http_timeout_s)

    def backoff(self, attempts: int) -> float:
        return min(self.cfg.backoff_base_s * 2 ** max(attempts - 1, 0), self.cfg.backoff_max_s)

    async def _settle(self, job: Job, rev: int, result: PushResult) -> None:
        detail = f"{result.status or ''} {result.detail}".strip()
        match result.outcome:
            case "sent":
                await self._finish(job, rev, "sent")
                log.info("notified", principal=job.principal, moment_id=job.moment_id, kind=job.kind,
                         channel=job.channel, attempts=job.attempts)
            case "gone":
                await self.store.delete_subscription(job.principal, job.channel.removeprefix("push-"))
                await self._finish(job, rev, "dropped", detail)
                log.info("push subscription gone; dropped", principal=job.principal, channel=job.channel,
                         status=result.status)
            case "retry" if job.attempts < self.cfg.max_attempts:
                delay = max(self.backoff(job.attempts), result.retry_after_s or 0.0)
                job.status, job.last_error, job.due = "scheduled", detail, time.time() + delay
                if await self.store.update_job(job, rev) is not None:
                    self._schedule(job.key, job.due)
                metrics.NOTIFICATIONS.labels(job.channel.split("-", 1)[0], "retry").inc()
                log.warning("notification failed (transient); will retry", channel=job.channel,
                            moment_id=job.moment_id, attempt=job.attempts, retry_in_s=round(delay, 2), error=detail)
            case _:
                reason = (f"gave up after {job.attempts} attempts: " if result.outcome == "retry"
                          else "refused: ") + detail
                await self.store.dead_letter(job, reason)
                await self._finish(job, rev, "dead", reason)
                log.error("notification dead-lettered", channel=job.channel, moment_id=job.moment_id,
                          principal=job.principal, reason=reason)

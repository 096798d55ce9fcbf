"""The signer: one signed Agent Action Capsule for every verdict (spec 004, DESIGN §6).

A durable pull consumer on ``PGW_VERDICTS``. For each verdict:

1. look the verdict up in the signer's ledger (see below); if it was already
   signed (a redelivery after a crash), reuse the recorded payload verbatim;
2. otherwise build the capsule (:func:`consumers.capsule_map.capsule_from_verdict`),
   append a ledger entry for it, and use that;
3. sign the payload as a COSE_Sign1 (Ed25519 is deterministic, so the same
   payload gives the same bytes) and publish it to ``capsule.register`` with
   ``Nats-Msg-Id`` = capsule_id, waiting for the PubAck;
4. only then ack the verdict.

The ledger (§5.3 ``ledger_mode: chained``) is a hash chain over every capsule
the signer signed, kept in its own stream ``PGW_SIGNER_LEDGER`` (subject
``{prefix}.signer.ledger.{verdict_id}``). Position *n* is the stream
sequence; an entry is appended with ``Nats-Expected-Last-Sequence`` = *n-1*
(so concurrent signers cannot fork the chain: the loser re-reads the head and
retries) and ``Nats-Msg-Id`` = verdict_id. The entry stores the complete
signed payload, so the chain position is assigned once per verdict: a
redelivered verdict finds its entry (by subject, which survives any dedup
window) and is re-signed from the stored payload, byte for byte.

Batches: the verdicts of one fetch (``signer.batch``) are worked together.
Their new ledger entries are appended as one JetStream atomic batch whose
first message carries ``Nats-Expected-Last-Sequence`` (the whole run lands
right after the head it was chained onto, or none of it does), and their
capsules are published as a second atomic batch; each is synced once at its
commit. A batch the server refuses (a duplicate id, a stream without
``allow_atomic``) is redone one message at a time, as described above. The
next batch is built while one batch's ledger run is being stored and its
statements signed; runs are still appended one after the other, in fetch
order (see :meth:`Signer._run`). A batch's ledger links, its capsules and its
acks are each handed to the connection as one write (:mod:`pgwcore.pubbatch`).

Key rotation (``pgw keys --rotate signer``, docs/capsules.md "Keys"): the signer reads
its role's ``active`` file every ``key_check_s`` seconds and, when it names another kid,
loads that key by its kid and signs with it from the next statement on; a signing pool
is replaced by one holding the new key while the old one finishes what it was given.
The STATS reply of the services API carries the kid it signs with (``signing_kid``), so
the command can tell which running signers took the key. A redelivered verdict signed
before the rotation is re-signed from its ledger entry with the new key: the same
payload and capsule_id (the ``Nats-Msg-Id`` dedup still holds), another signature.

Residual: if the signer dies after publishing a capsule but before acking the
verdict, and the verdict is redelivered only after ``PGW_REGISTRATION``'s
duplicate window (``gateway.duplicate_window_s``) has passed, the repeat
publish is not deduplicated; the repeat is byte-identical and carries the
same capsule_id, so consumers can still drop it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from datetime import UTC
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
from nats.errors import Error as NatsError
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
)
from nats.js.errors import APIError

from consumers import capsule_outcome, profiles
from consumers.capsule import CapsuleError
from consumers.signer_checkpoints import CheckpointSigner
from consumers.signer_ledger import (
    LEDGER_STREAM,
    LedgerEntry,
    LedgerMixin,
    _Head,
    _Job,
    claims_for,
    sign_payload,
)
from consumers.signer_pool import SigningPool, resolve_workers
from pgwcore import tracing
from pgwcore.atomic import (
    ERR_ATOMIC_DISABLED,
    MAX_BATCH,
    publish_atomic,
)
from pgwcore.keys import MissingKeyError, SigningKey, load_kid, load_or_create
from pgwcore.logs import get_logger
from pgwcore.pubbatch import ack_all
from pgwcore.pull import fetch_ready
from pgwcore.service import PullService, delivery, hand_back
from subjects.errors import PgwError
from subjects.wire import Verdict, verdict_decoder

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from pgwcore.config import Config

log = get_logger("pgw.signer")

# Kept importable from here: the ledger half of the signer lives in consumers.signer_ledger.
__all__ = ["LEDGER_STREAM", "LedgerEntry", "Signer", "_Head", "_Job", "claims_for", "load_or_create_salt",
           "salt_path", "sign_payload"]

VERDICT_STREAM = "PGW_VERDICTS"
REGISTRATION_STREAM = "PGW_REGISTRATION"


def load_or_create_salt(path: Path, *, create: bool = True) -> str:
    """The per-tenant salt (§13), 32 random bytes as hex, created 0600 on first use (when ``create``).

    A new salt changes every salted digest from then on, so with ``keys.create = false``
    a missing salt stops the signer like a missing key does.
    """
    if not create and not path.exists():
        raise MissingKeyError("the signer's salt", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PgwError(f"salt file {path} has mode {mode:o}; it must be 0600")
    return path.read_text().strip()


def salt_path(config: Config) -> Path:
    if config.signer.tenant_salt_file:
        return Path(config.signer.tenant_salt_file).expanduser()
    return config.data_path / "signer" / "tenant_salt"


class Signer(LedgerMixin, PullService):
    """The signer service; its life cycle (start, idempotent ``drain()``, close) is ``PullService``'s."""

    name = "signer"
    key_check_s: ClassVar[float] = 1.0  # how often the active key file is read (a rotation, above)

    def __init__(self, config: Config, nc: Client) -> None:
        super().__init__(config, nc)
        self.key: SigningKey | None = None
        self.salt = ""
        self._head: _Head | None = None
        self._atomic_ledger = False
        self._atomic_register = False
        self._timeout = 10.0  # a durable write unanswered this long counts as failed
        self.signed = 0
        self._progress = asyncio.Condition()
        self.checkpoints: CheckpointSigner | None = None
        self.pool: SigningPool | None = None  # signer.workers: signing on other cores
        self._runs: dict[asyncio.Task[list[_Job]], set[str]] = {}  # ledger runs in flight -> their verdict ids

    # -- life cycle ---------------------------------------------------------
    async def start(self) -> None:
        self.profile = profiles.profile(self.config.signer.capsule_format)  # fails at start, format named
        self.key = load_or_create(self.config.data_path, "signer", create=self.config.keys.create,
                                  keys_dir=self.config.keys_path)
        self.salt = load_or_create_salt(salt_path(self.config), create=self.config.keys.create)
        workers = resolve_workers(self.config.signer.workers)
        if workers:
            self.pool = SigningPool(self.key, self.config.data_path, self.config.keys_path, workers)
            await self.pool.start()  # fails at start if a worker cannot sign with this very key
        await self._ensure_ledger()
        sc = self.config.signer
        self._sub = await self.js.pull_subscribe(
            self.subjects.all_verdicts,
            durable=sc.durable,
            stream=VERDICT_STREAM,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=sc.ack_wait_s,
                max_deliver=-1,  # a verdict is never dropped: every verdict gets its capsule
                max_ack_pending=sc.batch * 4,
            ),
        )
        await self._fit_durable(sc.batch * 4)
        self.spawn(self._run(), name="pgw-signer")
        self.spawn(self._follow_key(), name="pgw-signer-key")
        # The event log's anchored heads, on to the Transparency Service (issue 20).
        self.checkpoints = CheckpointSigner(self)
        await self.checkpoints.start()
        log.info("signer started", kid=self.key.kid, durable=sc.durable, sign_workers=workers)

    async def _fit_durable(self, want: int) -> None:
        """An existing durable (made with a smaller ``signer.batch``) gets room for the pipeline's batches.

        nats-py binds to an existing durable as it is; ``max_ack_pending`` is
        an editable consumer setting, so it is raised here, or the loop would
        wait on a window a quarter of its size.
        """
        durable = self.config.signer.durable
        info = await self.js.consumer_info(VERDICT_STREAM, durable)
        have = info.config.max_ack_pending
        if have is None or have < 0 or have >= want:
            return
        info.config.max_ack_pending = want
        try:
            await self.js.add_consumer(VERDICT_STREAM, config=info.config)
        except APIError as e:
            log.warning("could not widen the signer's durable; it runs with the narrower window",
                        durable=durable, max_ack_pending=have, wanted=want, error=e.description)
        else:
            log.info("signer durable widened", durable=durable, max_ack_pending=want)

    def ops_stats(self) -> dict[str, Any]:
        """STATS data of the services API: the kid this instance signs with (`pgw keys --rotate signer`)."""
        return {"signing_kid": self.key.kid} if self.key is not None else {}

    async def _follow_key(self) -> None:
        """Take a rotated key without a restart (the module docstring, "Key rotation").

        A key that cannot be loaded is logged once (per kid) and the signer goes on
        signing with the key it has: every capsule stays signed by a trusted key.
        """
        active = self.config.keys_path / "signer" / "active"
        failed: str | None = None
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.key_check_s)
            if self.stopping.is_set():
                return
            try:
                kid = (await asyncio.to_thread(active.read_text)).strip()
            except OSError:
                continue  # being replaced (rotate writes it atomically), or the folder moved: next time
            if not kid or self.key is None or kid in (self.key.kid, failed):
                continue
            try:
                await self._take_key(kid)
                failed = None
            except Exception as e:  # noqa: BLE001 - logged; the current key keeps signing
                failed = kid
                log.error("the signer could not take the new active key; it keeps signing with its key",
                          kid=kid, signing_kid=self.key.kid, error=str(e))

    async def _take_key(self, kid: str) -> None:
        key = await asyncio.to_thread(load_kid, self.config.data_path, "signer", kid, keys_dir=self.config.keys_path)
        old, retired = self.pool, self.key
        if old is not None and old.active:
            pool = SigningPool(key, self.config.data_path, self.config.keys_path, old.workers)
            await pool.start()  # SigningPoolError if the workers cannot sign as ``kid``: the old key stays
            self.pool = pool
            self.spawn(old.close(finish=True), name="pgw-signer-retired-pool")
        elif old is not None:
            old.key = key  # a pool given up on signs in process, with its own key
        self.key = key
        log.info("signer key changed: new statements are signed with the rotated key",
                 kid=key.kid, retired_kid=retired.kid if retired else None)

    async def stop_inputs(self) -> None:
        """The checkpoint input stops first; then ``drain()`` lets the batch in hand finish."""
        if self.checkpoints is not None:
            await self.checkpoints.drain()

    async def close(self) -> None:
        """The signing workers stop once the loop has stored what it held."""
        pool, self.pool = self.pool, None
        if pool is not None:
            await pool.close()

    async def wait_signed(self, n: int, timeout: float | None = None) -> None:
        """Wait until this instance has stored ``n`` capsules (tests, benchmarks)."""
        async with self._progress:
            await asyncio.wait_for(self._progress.wait_for(lambda: self.signed >= n), timeout)

    # -- the loop -----------------------------------------------------------
    async def _run(self) -> None:
        """Four overlapping stages: fetch the next batch, build this one, chain the previous one, store.

        A fetched batch is decoded and its capsules built (:meth:`_stage_batch`,
        CPU) while the batch before it is still being chained: its ledger run
        stored (an fsync at the server) and its statements signed. Ledger runs
        are appended one after the other in fetch order (:meth:`_append_staged`
        waits for the run before it), so the chain is the one a batch-by-batch
        loop makes; a batch's capsules are stored once its run is stored and
        its statements signed, and only then are its verdicts acked. At most
        two batches are storing (their runs included), one building and one
        fetched ahead, which the consumer's ``max_ack_pending`` (4 batches) allows.
        """
        # A verdict yields at most two statements (its capsule and an outcome beside it, spec 004
        # §3.3), and a batch's links and capsules each go in one atomic batch of at most MAX_BATCH.
        batch = min(self.config.signer.batch, MAX_BATCH // 2)
        storing: set[asyncio.Task[None]] = set()
        ahead: asyncio.Future[list[Msg]] | None = None
        appending: asyncio.Task[list[_Job]] | None = None  # the newest ledger run (each waits for the one before)
        unstored: asyncio.Task[list[_Job]] | None = None  # a run whose store task is not started yet
        try:
            while not self.stopping.is_set():
                msgs = await (ahead or self._fetch(batch))
                ahead = None
                if msgs is None:
                    return
                if not msgs:
                    continue
                ahead = asyncio.ensure_future(self._fetch(batch))
                try:
                    staged = await self._stage_batch(msgs, appending)
                except Exception:
                    # E.g. a redelivery's ledger lookup timing out while a node fails over: the loop
                    # must outlive it (it ended here before, and the signer sat idle), and the batch
                    # comes back. What it had already handed back or terminated refuses a second nak.
                    log.exception("building a batch failed; its verdicts are left for redelivery", count=len(msgs))
                    await hand_back(msgs)
                    continue
                appending = unstored = asyncio.create_task(self._append_staged(staged, appending),
                                                           name="pgw-signer-chain")
                self._runs[appending] = staged.vids
                appending.add_done_callback(self._run_done)
                while len(storing) >= 2:
                    await asyncio.wait(storing, return_when=asyncio.FIRST_COMPLETED)
                self._store_after(unstored, storing)
                unstored = None
        finally:
            if unstored is not None:
                self._store_after(unstored, storing)
            if ahead is not None:  # fetched but not worked on: hand back for prompt redelivery
                for m in await ahead or []:
                    with contextlib.suppress(Exception):
                        await m.nak()
            if storing:
                await asyncio.gather(*storing, return_exceptions=True)

    def _run_done(self, task: asyncio.Task[list[_Job]]) -> None:
        self._runs.pop(task, None)

    def _store_after(self, run: asyncio.Task[list[_Job]], storing: set[asyncio.Task[None]]) -> None:
        """Store the capsules of ``run``'s batch once its ledger run is stored (a task in ``storing``)."""
        async def store() -> None:
            try:
                await self._publish_jobs(await run)
            except Exception:  # its verdicts are not acked: they come back after ack_wait
                log.exception("storing a batch failed; its verdicts are left for redelivery")

        task = asyncio.create_task(store(), name="pgw-signer-store")
        storing.add(task)
        task.add_done_callback(storing.discard)

    async def _fetch(self, batch: int) -> list[Msg] | None:
        """The next verdicts; [] when none came in time, None when the loop should end."""
        # the ready batch without a task per message
        return await self.fetch(lambda: fetch_ready(self._sub, batch, timeout=0.5), log)

    async def _stage_batch(self, msgs: list[Msg], before: asyncio.Task[list[_Job]] | None) -> _Staged:
        """Decode the batch and build its capsules (not yet linked); ``before``: the ledger run in flight.

        A verdict that cannot be built now is nak'ed on its own; the rest go on.
        A supersedes parent in a run still being stored is waited for (its
        capsule_id is known once the run is stored), so the child is built as
        a batch-by-batch loop builds it.
        """
        staged = _Staged()
        jobs = staged.jobs
        for m in msgs:
            try:
                verdict = verdict_decoder.decode(m.data)
            except (msgspec.DecodeError, ValueError) as e:
                # Not a verdict at all: there is no action to record. Kept out of the loop, loudly.
                log.error("undecodable verdict message terminated", subject=m.subject, error=str(e))
                await m.term()
                continue
            primary = _Job(m, verdict)
            jobs.append(primary)
            staged.vids.add(verdict.verdict_id)
            # spec 004 §3.3: an outcome statement beside the action's capsule, acked with it.
            extra = capsule_outcome.companion(verdict) if self.profile.outcomes else None
            if extra is not None:
                jobs.append(_Job(None, extra, ack_with=primary))
                staged.vids.add(extra.verdict_id)
        if before is not None and not before.done():
            flying = set().union(*self._runs.values())
            if any(j.verdict.supersedes in flying and j.verdict.supersedes not in staged.vids for j in jobs):
                await asyncio.wait([before])
        await self._recall(jobs)
        built: set[str] = set()  # verdict ids built in this batch (a parent may be here, not yet linked)
        for job in jobs:
            if id(job.ack_with) in staged.naked:
                continue  # its action's capsule waits for redelivery: so does the outcome
            if job.entry is None:
                vid = job.verdict.verdict_id
                try:
                    job.built = await self._build(job.verdict, job.msg, built, job)
                except _ParentPending as e:
                    await staged.hand_back(job, min(0.2 * e.deliveries, 2.0))
                    continue
                except CapsuleError:
                    log.exception("capsule construction refused; verdict left for redelivery", verdict_id=vid,
                                  traceparent=job.verdict.traceparent)
                    await staged.hand_back(job, 5.0)
                    continue
                except Exception:
                    log.exception("signing failed; verdict left for redelivery", verdict_id=vid,
                                  traceparent=job.verdict.traceparent)
                    await staged.hand_back(job, 1.0)
                    continue
                built.add(vid)
            staged.ready.append(job)
        return staged

    async def _append_staged(self, staged: _Staged, before: asyncio.Task[list[_Job]] | None) -> list[_Job]:
        """Chain a built batch (ledger stored) and sign it; return the jobs whose capsule can be stored.

        Waits first for ``before``, the run of the batch fetched before this
        one, so runs land in the ledger in fetch order. The batch's new ledger
        links are appended as one chained atomic batch (:meth:`_append_jobs`)
        and :meth:`_publish_jobs` stores its capsules as another: two durable
        writes for the whole batch instead of two per capsule, each verdict
        acked only after its capsule is stored.
        """
        if before is not None:
            await asyncio.wait([before])  # its failure is its own: it handed its verdicts back
        naked = staged.naked
        ready = staged.ready
        new = [j for j in ready if j.entry is None and id(j.ack_with or j) not in naked]
        if new:
            try:
                await self._append_jobs(new)
            except Exception:
                log.exception("ledger append failed; verdicts left for redelivery", count=len(new))
                for j in new:
                    await staged.hand_back(j, 1.0)
        # A verdict goes on only with all of its statements (an outcome beside its capsule, §3.3).
        ready = [j for j in ready if j.entry is not None and id(j.ack_with or j) not in naked]
        assert self.key is not None
        for job in ready:  # replayed entries; new ones were signed while their ledger run was stored
            if not job.statement and job.signing is None:
                assert job.entry is not None
                job.statement = sign_payload(job.entry.payload.encode(), self.key)
        return ready

    async def sign_verdict(self, verdict: Verdict, msg: Msg | None = None) -> tuple[bytes, str, str]:
        """(statement bytes, capsule_id, "new" | "replayed") for ``verdict``, without publishing it."""
        assert self.key is not None
        job = _Job(msg, verdict)
        await self._recall([job])
        if job.entry is None:
            job.built = await self._build(verdict, msg, set(), job)
            await self._append_jobs([job])
        assert job.entry is not None
        return sign_payload(job.entry.payload.encode(), self.key), job.entry.capsule_id, job.status

    async def _recall(self, jobs: list[_Job]) -> None:
        """Find the recorded ledger entry of every verdict that may have been signed before.

        A first delivery cannot have been signed before, except when the same
        verdict reached the stream twice; the ledger's Msg-Id dedup (window:
        signer.ledger_duplicate_window_s) catches that case when appending.
        Redeliveries look the verdict up by subject, which has no window at all.
        """
        again = [j for j in jobs if j.msg is None or delivery(j.msg)[1] > 1]
        found = await asyncio.gather(*(self._lookup(j.verdict.verdict_id) for j in again))
        for job, entry in zip(again, found, strict=True):
            if entry is not None:
                job.entry, job.status = entry, "replayed"

    async def _build(self, verdict: Verdict, msg: Msg | None, built: set[str], job: _Job) -> Any:
        """The capsule of ``verdict`` as the configured profile builds it, not yet linked.

        A supersedes parent built earlier in the same batch has no capsule_id
        yet (the id covers its ledger position, §5.1); ``job.parent_vid``
        names it and the chain block is added when the run is linked.
        """
        parent = None
        if verdict.supersedes:
            if verdict.supersedes in built:
                job.parent_vid = verdict.supersedes
            else:
                pentry = await self._lookup(verdict.supersedes)
                if pentry is not None:
                    parent = pentry.capsule_id
                elif msg is not None:
                    # Spec 004 §5.4.4: the closure of an open item is its supersedes link. Signed
                    # without it, the parent would stay open for ever (and the id, which covers
                    # ledger_mode, would differ), so the child waits for its parent however long.
                    deliveries = msg.metadata.num_delivered
                    if deliveries >= self.config.signer.parent_wait_deliveries:
                        log.warning("superseded parent not signed yet; the verdict waits for it",
                                    verdict_id=verdict.verdict_id, parent_verdict=verdict.supersedes,
                                    deliveries=deliveries, traceparent=verdict.traceparent)
                    raise _ParentPending(deliveries)
        job.profile = self.profile
        return self.profile.build(
            verdict,
            operator=self.config.operator,
            salt=self.salt,
            default_developer=self.config.signer.developer,
            authority=self.config.signer.authority,
            parent_capsule_id=parent,
            fallback_ts=lambda: _stream_time(msg),
        )

    async def _publish_jobs(self, jobs: list[_Job]) -> None:
        """Store every job's capsule in ``capsule.register`` (one atomic batch), then ack its verdict."""
        t0 = time.time_ns()  # the batch's start: each capsule's span (pgwcore/tracing.py)
        if not jobs:
            return
        if not await self._await_statements(jobs):
            return
        items = [(self.subjects.capsule_register, j.statement, self._capsule_headers(j)) for j in jobs]
        stored: list[bool] | None = None
        duplicate = [False] * len(jobs)
        if self._atomic_register:
            try:
                await publish_atomic(self.nc, items, timeout=self._timeout)
                stored = [True] * len(jobs)
            except APIError as e:
                if e.err_code == ERR_ATOMIC_DISABLED:
                    self._atomic_register = False
                # A capsule stored before (a redelivery after a crash) refuses the whole batch:
                # publish one by one, which settles each duplicate on its own.
            except (NatsError, TimeoutError) as e:
                log.warning("atomic capsule batch failed; publishing one by one", count=len(jobs), error=repr(e))
        if stored is None:
            acks = await asyncio.gather(
                *(self.js.publish(subject, data, headers=dict(headers)) for subject, data, headers in items),
                return_exceptions=True,
            )
            stored = []
            for i, ack in enumerate(acks):
                if isinstance(ack, BaseException):
                    log.error("capsule publish failed; verdict left for redelivery",
                              verdict_id=jobs[i].verdict.verdict_id, error=repr(ack),
                              traceparent=jobs[i].verdict.traceparent)
                    stored.append(False)
                else:
                    stored.append(True)
                    duplicate[i] = bool(ack.duplicate)
        blog = log.bind()  # one bound logger per batch: the module's lazy proxy binds anew on every call
        # A verdict is acked only once every statement it yields (capsule, outcome) is stored.
        all_stored: dict[int, bool] = {}
        for job, ok in zip(jobs, stored, strict=True):
            owner = job.ack_with or job
            all_stored[id(owner)] = all_stored.get(id(owner), True) and ok
        # The acks of the batch go to the connection at once (pgwcore.pubbatch), after every store.
        acks: list[Msg] = []
        for job, ok in zip(jobs, stored, strict=True):
            if job.msg is not None:
                if all_stored.get(id(job), ok):
                    acks.append(job.msg)
                else:
                    await job.msg.nak(delay=1.0)
        await ack_all(self.nc, acks)
        for job, ok, dup in zip(jobs, stored, duplicate, strict=True):
            if ok:
                tracing.record("pgw.signer.capsule", job.verdict.traceparent, t0, capsule_id=job.entry.capsule_id,
                               verdict_class=job.verdict.verdict_class, duplicate=dup)
                blog.info("capsule signed", verdict_id=job.verdict.verdict_id, capsule_id=job.entry.capsule_id,
                          verdict_class=job.verdict.verdict_class, ledger=job.status, duplicate=dup,
                          traceparent=job.verdict.traceparent)
        self.signed += sum(stored)
        async with self._progress:
            self._progress.notify_all()

    async def _await_statements(self, jobs: list[_Job]) -> bool:
        """Fill in the statements the signing workers are making; False (batch handed back) if they fail.

        Their ledger links are stored, so a redelivered verdict is re-signed from its link.
        """
        runs = {id(j.signing): j.signing for j in jobs if j.signing is not None}
        if not runs:
            return True
        try:
            await asyncio.gather(*runs.values())
        except Exception:
            log.exception("signing failed; verdicts left for redelivery", count=len(jobs))
            for job in jobs:
                if job.msg is not None:
                    await job.msg.nak(delay=1.0)
            return False
        for job in jobs:
            if job.signing is not None:
                job.statement = job.signing.result()[job.sign_index]
                job.signing = None
        return True

    def _capsule_headers(self, job: _Job) -> dict[str, str]:
        assert job.entry is not None
        cid = job.entry.capsule_id
        headers = {"Nats-Msg-Id": cid, "Pgw-Capsule-Id": cid, "Pgw-Verdict-Id": job.verdict.verdict_id}
        if job.verdict.traceparent:
            headers["traceparent"] = job.verdict.traceparent
        return headers

def _stream_time(msg: Msg | None) -> str | None:
    """The verdict's JetStream storage time: fixed for every redelivery of the message."""
    if msg is None:
        return None
    try:
        return msg.metadata.timestamp.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    except Exception:  # noqa: BLE001 - only a fallback
        return None


class _Staged:
    """A fetched batch between building and chaining: its jobs, those built, those handed back."""

    def __init__(self) -> None:
        self.jobs: list[_Job] = []
        self.ready: list[_Job] = []  # built (or found in the ledger), in fetch order
        self.vids: set[str] = set()  # the batch's verdict ids (a parent of a later batch may be here)
        self.naked: set[int] = set()  # ids of the verdict jobs handed back (with every statement they yield)

    async def hand_back(self, job: _Job, delay: float) -> None:
        owner = job.ack_with or job
        if id(owner) not in self.naked:
            self.naked.add(id(owner))
            if owner.msg is not None:
                await owner.msg.nak(delay=delay)


class _ParentPending(Exception):
    def __init__(self, deliveries: int) -> None:
        self.deliveries = deliveries

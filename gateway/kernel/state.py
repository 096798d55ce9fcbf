"""Kernel state: the idp_id index and per-session state, shared by every instance.

Kept in the JetStream KV bucket ``PGW_KERNEL`` (file storage), so every
gateway instance sees the same index and a restart loses nothing. Every
change is a compare-and-set on the entry's revision (``create`` for a new
entry, ``update(last=rev)`` otherwise), so two instances cannot both advance
one session's step_sequence or both record one idp_id.

The event log is the ground truth (spec 003 §8.4: the index is "rebuilt from
the Event Log on kernel restart"): at start ``rebuild`` replays every event of
the kernel's own (``eventlog.walk_log``: signed and chained; a foreign record is
never applied) after the bucket's ``_checkpoint`` and applies it idempotently (status
only moves forward, ``last_step`` is a max, mismatch counts are sets), so a
bucket that lags the log - a crash between the log append and the KV write -
or a bucket that was lost entirely is brought back to what the log says.

Keys:
* ``idp.{so_id}.{idp_id}``  -> ``IdpEntry`` (spec 003 §5.2(c): unique per governed object)
* ``tr.{agent}.{idp_id}``   -> so_id, to find the IDP a transition report names
* ``sess.{digest(agent, session_id)}`` -> ``SessionEntry`` (its queue of unanswered escalations)
* ``hold.{digest(agent, so_id)}`` -> ``HoldEntry``: escalations and terminations that hold
  every session of the agent on that governed object (spec 003 §4.4, §5.5.2)
* ``_checkpoint``           -> last log sequence the rebuild applied
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
from collections.abc import Collection
from typing import Any, Literal

import msgspec
from msgspec import Struct, field
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyWrongLastSequenceError

from gateway.kernel.eventlog import EventLog, walk_log
from pgwcore.atomic import ERR_WRONG_LAST_SEQ, AckInbox
from pgwcore.kvread import BatchReader, enable_direct, get_last
from pgwcore.logs import get_logger
from pgwcore.streams import ensure_kv
from subjects.errors import PgwError
from subjects.util import stable_id

log = get_logger("pgw.kernel.state")

BUCKET = "PGW_KERNEL"

IdpStatus = Literal[
    "submitted", "permitted", "denied", "hem_pending", "hem_approved", "hem_denied", "dispatched", "transitioned"
]
# Forward order of an IDP's life; a status never moves backwards.
_RANK = {
    "submitted": 0,
    "permitted": 1,
    "denied": 1,
    "hem_pending": 1,
    "hem_approved": 2,
    "hem_denied": 2,
    "dispatched": 2,  # the gate sent it to its executor (gateway/kernel/gate.py); no report is taken
    "transitioned": 3,
}
SessionState = Literal["ACTIVE", "HEM_PENDING", "TERMINATED"]
HemTrigger = Literal[
    "HEM_URGENCY_REQUIRED", "MISSION_REF_MISMATCH_THRESHOLD", "IDP_COMMITMENT_GAP", "TRANSITION_REPORTED_TWICE",
    "TRANSITION_WHILE_HELD",
]


class IdpEntry(Struct, kw_only=True, omit_defaults=True):
    idp_id: str
    so_id: str
    agent: str
    principal: str
    session_id: str
    step_sequence: int
    requested_action: str
    mandate_id: str
    profile: str
    submitted_seq: int
    status: IdpStatus = "submitted"
    moment_id: str | None = None
    transition_seq: int | None = None
    # The TRANSITION_REPORT_OVERDUE event that closed this permit (gateway/kernel/overdue.py).
    overdue_seq: int | None = None
    # The IDP_COMMITMENT_VERIFIED / _GAP event of its transition (spec 003 §5.5): a
    # redelivered report reuses it instead of writing a second one.
    verification_seq: int | None = None


class HemHold(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One unanswered escalation (spec 003 §5.5.2): its moment and what it holds.

    ``so_id`` and ``mandate_id`` name the governed object and mandate it holds
    (``HoldEntry``); both are None for an escalation recorded before holds
    existed, which holds its own session only.
    """

    moment_id: str
    idp_id: str
    session_id: str
    trigger: HemTrigger
    principal: str
    so_id: str | None = None
    mandate_id: str | None = None
    # The mandate's exp (a HEM_URGENCY_REQUIRED escalation): an approval after it, or after the mandate's
    # revocation, permits nothing (denials.py ``_apply_hem``). None for one recorded before it was kept.
    mandate_exp: float | None = None


class SessionEntry(Struct, kw_only=True, omit_defaults=True):
    agent: str
    session_id: str
    last_step: int = 0
    # The idp_id whose IDP_SUBMITTED took ``last_step``: a retry of that same
    # IDP racing itself on two instances finds the step already its own.
    last_idp: str | None = None
    state: SessionState = "ACTIVE"
    hem_idp_id: str | None = None
    hem_moment_id: str | None = None
    hem_trigger: HemTrigger | None = None
    hem_principal: str | None = None
    mismatches: list[str] = field(default_factory=list)
    # Every unanswered escalation of this session, oldest first (spec 003 §5.5.2:
    # a second one queues behind the first, each answer is logged and acted on).
    # The hem_* members above mirror its head, as they read before queues existed.
    hem_queue: list[HemHold] = field(default_factory=list)


class HoldEntry(Struct, kw_only=True, omit_defaults=True):
    """What holds one agent's work on one governed object, whatever the session (spec 003 §4.4, §5.5.2).

    ``pending``: escalations awaiting a human; while one is, every IDP of the
    agent for this object, in any session and under any mandate, is denied
    ``HEM_PENDING``. ``terminated``: mandates a human ended (a gap, repeated
    mismatches or a second report not approved); every session under one is
    refused ``SESSION_TERMINATED``. docs/kernel.md, "Session creation and the
    scope of a HEM block", says why this scope.
    """

    agent: str
    so_id: str
    pending: list[HemHold] = field(default_factory=list)
    terminated: list[str] = field(default_factory=list)


_idp_dec = msgspec.json.Decoder(IdpEntry)
_sess_dec = msgspec.json.Decoder(SessionEntry)
_hold_dec = msgspec.json.Decoder(HoldEntry)
_enc = msgspec.json.Encoder()


def _decode_session(data: bytes) -> SessionEntry:
    """A stored session; one written before queues existed gets its pending moment as a one-entry queue."""
    s = _sess_dec.decode(data)
    if s.state == "HEM_PENDING" and s.hem_moment_id and not s.hem_queue:
        s.hem_queue = [HemHold(moment_id=s.hem_moment_id, idp_id=s.hem_idp_id or "", session_id=s.session_id,
                               trigger=s.hem_trigger or "HEM_URGENCY_REQUIRED", principal=s.hem_principal or "")]
    return s


def _copy(s: SessionEntry) -> SessionEntry:
    return msgspec.structs.replace(s, mismatches=list(s.mismatches), hem_queue=list(s.hem_queue))


def idp_key(so_id: str, idp_id: str) -> str:
    return f"idp.{so_id.lower()}.{idp_id.lower()}"


def tr_key(agent: str, idp_id: str) -> str:
    return f"tr.{agent}.{idp_id.lower()}"


@functools.lru_cache(maxsize=8192)  # four lookups per request; a hash each
def session_key(agent: str, session_id: str) -> str:
    return f"sess.{stable_id('session', agent, session_id)}"


@functools.lru_cache(maxsize=8192)
def hold_key(agent: str, so_id: str) -> str:
    return f"hold.{stable_id('hold', agent, so_id.lower())}"


class ForeignRecord(PgwError):
    """A key of the kernel's holds a value the kernel never wrote (docs/security.md "Replies")."""

    def __init__(self, key: str) -> None:
        super().__init__(f"{key} holds no record of the kernel's")
        self.key = key


_SO_ID_VALUE = re.compile(rb"[0-9A-Fa-f-]{36}")  # what put_tr writes: the so_id, a UUID v4 (spec 003 §4.2)


class ConflictError(PgwError):
    """A compare-and-set lost against another writer; re-read and decide again."""


class KernelState:
    # Sessions this instance last read or wrote, with their revision (issue 18):
    # the next step of a session skips its read. Safe because the step is only
    # ever taken by a compare-and-set on that revision (spec 003 §5.2(f)): if
    # anyone wrote the session since, the CAS fails and the session is re-read,
    # so a stale entry can never let a step, a HEM_PENDING or TERMINATED
    # session through. It is used only to go on (ACTIVE, step above last_step);
    # every refusal is decided on a fresh read (``cached_session``).
    session_cache_size = 4096

    def __init__(self, js: JetStreamContext, acks: AckInbox | None = None) -> None:
        self.js = js
        self.kv: Any = None
        self._sessions: dict[str, tuple[SessionEntry, int]] = {}
        self._batch: BatchReader | None = None
        # The PubAcks' inbox of the writes (``_write``): the kernel's own (pgwcore.atomic.AckInbox,
        # shared with its event log); without one, an unstarted inbox, i.e. the connection's request inbox.
        self.acks = acks if acks is not None else AckInbox(js._nc)

    def _remember(self, s: SessionEntry, rev: int) -> None:
        key = session_key(s.agent, s.session_id)
        self._sessions.pop(key, None)
        if len(self._sessions) >= self.session_cache_size:
            del self._sessions[next(iter(self._sessions))]
        self._sessions[key] = (_copy(s), rev)

    def cached_session(self, agent: str, session_id: str, step: int) -> tuple[SessionEntry, int] | None:
        """The session as this instance last saw it, if it lets ``step`` go on (ACTIVE, a
        higher step): a copy and its revision, for a compare-and-set; else None (read it)."""
        got = self._sessions.get(session_key(agent, session_id))
        if got is None or got[0].state != "ACTIVE" or got[0].last_step >= step:
            return None
        return _copy(got[0]), got[1]

    async def open(self) -> None:
        self.kv = await ensure_kv(self.js, BUCKET)
        # The validation reads as one batched direct get where the bucket has one
        # replica (pgwcore.kvread.enable_direct says why not on a replicated one).
        if await enable_direct(self.js, BUCKET):
            self._batch = BatchReader(self.js._nc, self.js._prefix, BUCKET, self.js._timeout)
            await self._batch.start()

    async def close(self) -> None:
        if self._batch is not None:
            await self._batch.close()
            self._batch = None

    async def validation_reads(
        self, agent: str, so_id: str, idp_id: str, session_id: str | None
    ) -> tuple[tuple[IdpEntry, int] | None, str | None, tuple[SessionEntry, int] | None, tuple[HoldEntry, int]]:
        """The idp_id's index entry and report key (spec 003 §5.2(c)), the hold of the
        governed object (§4.4, §5.5.2) and, unless ``session_id`` is None, the session
        (§5.2(f)): one request where the bucket allows it, else the reads at once. The
        same answers as ``idp``, ``so_of``, ``session`` and ``hold``."""
        if self._batch is None:
            if session_id is None:
                known, reported, hold = await asyncio.gather(
                    self.idp(so_id, idp_id), self.so_of(agent, idp_id), self.hold(agent, so_id))
                return known, reported, None, hold
            known, reported, hold, read = await asyncio.gather(
                self.idp(so_id, idp_id), self.so_of(agent, idp_id), self.hold(agent, so_id),
                self.session(agent, session_id))
            return known, reported, read, hold
        keys = [idp_key(so_id, idp_id), tr_key(agent, idp_id), hold_key(agent, so_id)]
        if session_id is not None:
            keys.append(session_key(agent, session_id))
        got = await self._batch.get_many(keys)
        known = (_idp_dec.decode(got[0][0]), got[0][1]) if got[0] else None
        reported = got[1][0].decode() if got[1] else None
        hold = (_hold_dec.decode(got[2][0]), got[2][1]) if got[2] else (HoldEntry(agent=agent, so_id=so_id.lower()), 0)
        read: tuple[SessionEntry, int] | None = None
        if session_id is not None:
            if got[3] is None:
                read = SessionEntry(agent=agent, session_id=session_id), 0
            else:
                s = _decode_session(got[3][0])
                self._remember(s, got[3][1])
                read = s, got[3][1]
        return known, reported, read, hold

    # -- reads --------------------------------------------------------------
    async def _get(self, key: str) -> tuple[bytes, int] | None:
        # kv.get's answer (None for a missing, deleted or empty key) at about half
        # its client CPU (pgwcore.kvread); the request and the server's work are the same.
        return await get_last(self.js._nc, self.js._prefix, BUCKET, key, self.js._timeout)

    async def position(self, key: str) -> int:
        """A log position the kernel keeps in the bucket (``_checkpoint``, ``_permit_sweep``); 0 when absent.

        A value that is not the decimal the kernel writes is not its own: a party's JetStream publish with
        this key's subject as its reply subject makes nats-server store its acknowledgement here
        (docs/security.md "Replies"). It is read as 0, so the whole log is walked again (every step of
        that walk is idempotent), never trusted: before, one such publish made every start of the kernel
        fail."""
        return (await self.position_read(key))[0]

    async def position_read(self, key: str) -> tuple[int, bool]:
        """(``position(key)``, whether the stored value was foreign: its reader may write its own back)."""
        got = await self._get(key)
        if got is None:
            return 0, False
        text = got[0]
        if text.isdigit() and text.isascii() and len(text) <= 20:
            return int(text), False
        log.warning("a kernel position is no record of the kernel's; read as 0 (the log is walked again)",
                    key=key, revision=got[1])
        return 0, True

    async def idp(self, so_id: str, idp_id: str) -> tuple[IdpEntry, int] | None:
        got = await self._get(idp_key(so_id, idp_id))
        if not got:
            return None
        try:
            return _idp_dec.decode(got[0]), got[1]
        except msgspec.DecodeError:
            raise ForeignRecord(idp_key(so_id, idp_id)) from None

    async def so_of(self, agent: str, idp_id: str) -> str | None:
        got = await self._get(tr_key(agent, idp_id))
        if not got:
            return None
        if not _SO_ID_VALUE.fullmatch(got[0]):
            raise ForeignRecord(tr_key(agent, idp_id))
        return got[0].decode()

    async def repair_steps(self, eventlog: EventLog, steps: Collection[tuple[str, str]],
                           ) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
        """Write the kernel's records of some steps (``tr.`` and ``idp.``) again from the event log.

        For steps ``(agent, idp_id)`` whose records hold a value the kernel never wrote: a party's JetStream
        publish with the key's subject as its reply subject makes nats-server store its acknowledgement there
        (docs/security.md "Replies"). The agent knows both keys of its own steps, and such a value made its
        next report of the step read as undeclared, or fail until dead-lettered: a commitment gap or a second
        report escaped its escalation (found by an attack from the docs). The steps' signed events are in the
        log, which only the kernel writes (``walk_log`` passes over what it did not): each foreign key is
        deleted and each step's events applied again, idempotently, as the rebuild does.

        One walk of the whole log for every step given (``gateway.kernel.repairs`` gathers them: a walk per
        step made two publishes of an agent's cost the kernel a read of every record). Returns the steps the
        log declared (an ``IDP_SUBMITTED``), written again, and those whose records could not be (each step on
        its own); the others' foreign ``tr.`` value is deleted all the same."""
        steps = list(dict.fromkeys(steps))
        wanted: dict[str, set[str]] = {}  # idp_id lower-cased -> the agents asking for it
        for agent, idp_id in steps:
            await self._drop_foreign(tr_key(agent, idp_id))  # whether or not the log declared the step
            wanted.setdefault(idp_id.lower(), set()).add(agent)
        events: dict[tuple[str, str], list[tuple[str, dict[str, Any], int]]] = {}
        async for rec in walk_log(eventlog.js, eventlog.subjects, eventlog.keys, stream=eventlog.stream):
            if rec.problem is not None or rec.event is None:
                eventlog.report_foreign(rec, "the repair of a step's records")
                continue
            body = rec.event.body
            named = body.get("idp_id") or (body.get("record") or {}).get("idp_id")
            agents = wanted.get(named.lower()) if isinstance(named, str) else None
            for agent in agents or ():
                if body.get("agent", agent) == agent:
                    events.setdefault((agent, named.lower()), []).append((rec.event.event_type, body, rec.seq))
        declared: set[tuple[str, str]] = set()
        failed: set[tuple[str, str]] = set()
        for agent, idp_id in steps:
            step = events.get((agent, idp_id.lower()), [])
            submitted = next((b for t, b, _ in step if t == "IDP_SUBMITTED"), None)
            if submitted is None:
                continue
            try:
                await self._drop_foreign(idp_key(submitted["so_id"], idp_id))
                for event_type, body, seq in step:
                    await self.apply(event_type, body, seq)
            except Exception:  # e.g. the key aimed at again meanwhile: this step's reports fail, not the others'
                log.exception("writing a step's records again from the log failed", agent=agent, idp_id=idp_id)
                failed.add((agent, idp_id))
                continue
            declared.add((agent, idp_id))
        return declared, failed

    async def _drop_foreign(self, key: str) -> None:
        got = await self._get(key)
        if got is not None and not self._kernels(key, got[0]):
            log.critical("a kernel record of a step holds no record of the kernel's; deleted, written again from "
                         "the log where it declared the step", key=key)
            with contextlib.suppress(Exception):
                await self.kv.delete(key)

    @staticmethod
    def _kernels(key: str, value: bytes) -> bool:
        if key.startswith("tr."):
            return _SO_ID_VALUE.fullmatch(value) is not None
        try:
            _idp_dec.decode(value)
        except msgspec.DecodeError:
            return False
        return True

    async def session(self, agent: str, session_id: str) -> tuple[SessionEntry, int]:
        got = await self._get(session_key(agent, session_id))
        if got is None:
            return SessionEntry(agent=agent, session_id=session_id), 0
        s = _decode_session(got[0])
        self._remember(s, got[1])
        return s, got[1]

    async def hold(self, agent: str, so_id: str) -> tuple[HoldEntry, int]:
        got = await self._get(hold_key(agent, so_id))
        if got is None:
            return HoldEntry(agent=agent, so_id=so_id.lower()), 0
        return _hold_dec.decode(got[0]), got[1]

    # -- compare-and-set writes ----------------------------------------------
    async def _write(self, key: str, value: bytes, rev: int) -> int:
        """``kv.update(key, value, last=rev)`` (rev 0: the key must not exist) through
        ``publish_acked`` (about two thirds of ``kv.update``'s client CPU; through ``self.acks``): the same
        compare-and-set (``Nats-Expected-Last-Subject-Sequence``, checked by the server),
        the new revision, or ``KeyWrongLastSequenceError``."""
        try:
            ack = await self.acks.publish(f"$KV.{BUCKET}.{key}", value,
                                        {"Nats-Expected-Last-Subject-Sequence": str(rev)}, self.js._timeout)
        except APIError as e:
            if e.err_code != ERR_WRONG_LAST_SEQ:
                raise
            if rev != 0:
                raise KeyWrongLastSequenceError(description=e.description) from None
            # Taken, or a delete/purge marker nats' create writes over: let it decide.
            return await self.kv.create(key, value)
        return ack.seq

    async def _cas(self, key: str, value: bytes, rev: int) -> int:
        try:
            return await self._write(key, value, rev)
        except KeyWrongLastSequenceError as e:
            raise ConflictError(key) from e

    async def put_session(self, s: SessionEntry, rev: int) -> int:
        try:
            new = await self._cas(session_key(s.agent, s.session_id), _enc.encode(s), rev)
        except ConflictError:
            self._sessions.pop(session_key(s.agent, s.session_id), None)
            raise
        self._remember(s, new)
        return new

    async def put_idp(self, e: IdpEntry, rev: int) -> int:
        return await self._cas(idp_key(e.so_id, e.idp_id), _enc.encode(e), rev)

    async def put_tr(self, agent: str, idp_id: str, so_id: str) -> None:
        with contextlib.suppress(KeyWrongLastSequenceError):
            await self._write(tr_key(agent, idp_id), so_id.encode(), 0)

    async def update_session(
        self, agent: str, session_id: str, fn: Any, *, known: tuple[SessionEntry, int] | None = None
    ) -> SessionEntry:
        """Apply ``fn(entry) -> bool`` (True = changed) with CAS retries; return the result.

        ``known`` is an entry and revision the caller has just read: the first
        attempt starts from a copy of it instead of reading again. The write is
        still a compare-and-set on that revision, so if anyone wrote in between
        it fails and the retry re-reads and re-applies ``fn``.
        """
        for _ in range(20):
            if known is not None:
                s, rev = _copy(known[0]), known[1]
                known = None
            else:
                s, rev = await self.session(agent, session_id)
            if not fn(s):
                return s
            try:
                await self.put_session(s, rev)
                return s
            except ConflictError:
                continue
        raise ConflictError(session_key(agent, session_id))

    async def update_hold(self, agent: str, so_id: str, fn: Any) -> HoldEntry:
        """Apply ``fn(hold) -> bool`` (True = changed) to the hold of (agent, so_id) with CAS retries."""
        key = hold_key(agent, so_id)
        for _ in range(20):
            h, rev = await self.hold(agent, so_id)
            if not fn(h):
                return h
            try:
                await self._cas(key, _enc.encode(h), rev)
                return h
            except ConflictError:
                continue
        raise ConflictError(key)

    async def escalate(self, body: dict[str, Any]) -> SessionEntry | None:
        """Queue the moment of ``body`` (a ``HEM_ESCALATED`` body) on its session, which is
        HEM_PENDING from now, and on the hold of its governed object (``HoldEntry``); return
        the session as it was before, for ``unescalate`` (None if it already held this moment)."""
        fn = _escalate(body)
        before: list[SessionEntry] = []

        def take(s: SessionEntry) -> bool:
            prior = _copy(s)
            changed = bool(fn(s))
            before[:] = [prior] if changed else []
            return changed

        jobs = [self.update_session(body["agent"], body["session_id"], take)]
        scope = body.get("scope")
        if scope:
            jobs.append(self.update_hold(body["agent"], scope["so_id"], _hold_add(body)))
        await asyncio.gather(*jobs)
        return before[0] if before else None

    async def unescalate(self, body: dict[str, Any], prior: SessionEntry) -> None:
        """Undo ``escalate`` while the session still holds this moment: its event was never logged."""
        moment_id = body["moment_id"]

        def back(s: SessionEntry) -> bool:
            if not any(h.moment_id == moment_id for h in s.hem_queue):
                return False
            s.hem_queue = [h for h in s.hem_queue if h.moment_id != moment_id]
            if not s.hem_queue:
                s.state, s.hem_idp_id, s.hem_moment_id = prior.state, prior.hem_idp_id, prior.hem_moment_id
                s.hem_trigger, s.hem_principal = prior.hem_trigger, prior.hem_principal
            _mirror(s)
            return True

        def unhold(h: HoldEntry) -> bool:
            kept = [p for p in h.pending if p.moment_id != moment_id]
            changed, h.pending = len(kept) != len(h.pending), kept
            return changed

        jobs = [self.update_session(body["agent"], body["session_id"], back)]
        if body.get("scope"):
            jobs.append(self.update_hold(body["agent"], body["scope"]["so_id"], unhold))
        await asyncio.gather(*jobs)

    async def advance_idp(self, so_id: str, idp_id: str, status: IdpStatus, **extra: Any) -> IdpEntry | None:
        """Move an IDP forward to ``status`` (never backwards); None if unknown."""
        for _ in range(20):
            got = await self.idp(so_id, idp_id)
            if got is None:
                return None
            e, rev = got
            if _RANK[status] < _RANK[e.status] or (e.status == status and not extra):
                return e
            e.status = status
            for k, v in extra.items():
                setattr(e, k, v)
            try:
                await self.put_idp(e, rev)
                return e
            except ConflictError:
                continue
        raise ConflictError(idp_key(so_id, idp_id))

    async def mark_overdue(self, so_id: str, idp_id: str, seq: int) -> None:
        """Record that ``TRANSITION_REPORT_OVERDUE`` at ``seq`` closed this permit (status unchanged)."""
        for _ in range(20):
            got = await self.idp(so_id, idp_id)
            if got is None or got[0].overdue_seq is not None:
                return
            e, rev = got
            e.overdue_seq = seq
            try:
                await self.put_idp(e, rev)
                return
            except ConflictError:
                continue
        raise ConflictError(idp_key(so_id, idp_id))

    # -- rebuild from the log (spec 003 §8.4) -----------------------------------
    async def rebuild(self, eventlog: EventLog) -> int:
        """Apply every event of the kernel's own after the checkpoint; return how many were applied.

        The walk is the log's one reader (``eventlog.walk_log``): a record that is not the
        kernel's own (undecodable, not signed by a kernel key, not chained) is never applied
        (spec 003 §8.2: only the kernel writes the log), and is reported with its sequence."""
        start, foreign_position = await self.position_read("_checkpoint")
        info = await eventlog.js.stream_info(eventlog.stream)
        last = info.state.last_seq or 0
        if last <= start:
            if foreign_position:
                await self.kv.put("_checkpoint", str(last).encode())  # the kernel's own value back
            return 0
        applied = foreign = 0
        async for rec in walk_log(eventlog.js, eventlog.subjects, eventlog.keys, stream=eventlog.stream,
                                  from_seq=start + 1, to_seq=last):
            if rec.problem is not None or rec.event is None:
                foreign += 1
                eventlog.report_foreign(rec, "the rebuild of the kernel state")
                continue
            try:
                await self.apply(rec.event.event_type, rec.event.body, rec.seq)
                applied += 1
            except Exception:
                log.exception("could not apply log event during rebuild", seq=rec.seq)
        await self.kv.put("_checkpoint", str(last).encode())
        log.info("kernel state rebuilt from the event log", applied=applied, not_the_kernels=foreign,
                 from_seq=start + 1, to_seq=last)
        return applied

    async def apply(self, event_type: str, body: dict[str, Any], seq: int) -> None:
        """Apply one log event to the state, idempotently."""
        match event_type:
            case "IDP_SUBMITTED":
                so_id, idp_id, agent = body["so_id"], body["idp_id"], body["agent"]
                if await self.idp(so_id, idp_id) is None:
                    entry = IdpEntry(
                        idp_id=idp_id,
                        so_id=so_id,
                        agent=agent,
                        principal=body["principal"],
                        session_id=body["session_id"],
                        step_sequence=body["step_sequence"],
                        requested_action=body["requested_action"],
                        mandate_id=body["mandate_id"],
                        profile=body["profile"],
                        submitted_seq=seq,
                    )
                    with contextlib.suppress(ConflictError):
                        await self.put_idp(entry, 0)
                await self.put_tr(agent, idp_id, so_id)
                await self.update_session(agent, body["session_id"], bump_step(body["step_sequence"], idp_id))
            case "CEDAR_PERMIT_RECORDED":
                await self.advance_idp(body["so_id"], body["idp_id"], "permitted")
            case "CEDAR_DENY_RECORDED" | "IDP_SUBMISSION_VOIDED":
                await self.advance_idp(body["so_id"], body["idp_id"], "denied")
            case "GATE_DISPATCHED":
                await self.advance_idp(body["so_id"], body["idp_id"], "dispatched")
            case "STATE_TRANSITIONED":
                await self.advance_idp(body["so_id"], body["idp_id"], "transitioned", transition_seq=seq)
            case "IDP_COMMITMENT_VERIFIED" | "IDP_COMMITMENT_GAP":
                await self.advance_idp(body["so_id"], body["record"]["idp_id"], "transitioned", verification_seq=seq)
            case "IDP_MISSION_REF_MISMATCH_REJECTED":
                idp_id = body["idp_id"]

                def count(s: SessionEntry) -> bool:
                    if idp_id in s.mismatches:
                        return False
                    s.mismatches.append(idp_id)
                    return True

                await self.update_session(body["agent"], body["session_id"], count)
            case "HEM_ESCALATED":
                if body.get("so_id") and body["trigger"] == "HEM_URGENCY_REQUIRED":
                    await self.advance_idp(body["so_id"], body["idp_id"], "hem_pending", moment_id=body["moment_id"])
                await self.update_session(body["agent"], body["session_id"], _escalate(body))
                if body.get("scope"):
                    await self.update_hold(body["agent"], body["scope"]["so_id"], _hold_add(body))
            case "HEM_RESOLVED":
                await self.resolve_hem(body)
            case "TRANSITION_REPORT_OVERDUE":
                await self.mark_overdue(body["so_id"], body["idp_id"], seq)

    async def resolve_hem(self, body: dict[str, Any]) -> SessionEntry:
        """Apply a HEM decision (``HEM_RESOLVED`` body): idempotent by moment id.

        The moment leaves its session's queue and its object's hold. Approving
        a ``HEM_URGENCY_REQUIRED`` moment permits its IDP; any other answer to
        it refuses the IDP and leaves the session going. A commitment gap,
        repeated mission mismatches or a second report that the human did not
        approve ends the session and its mandate (spec 003 §5.5.2): the hold
        records the mandate as terminated, so every session under it is
        refused. The session is ACTIVE again once its queue is empty.
        """
        trigger, decision = body["trigger"], body["decision"]
        # ``void``: she approved after the mandate was revoked or had expired (denials.py): no permit.
        approve = decision == "approve" and not body.get("void")
        ends = trigger != "HEM_URGENCY_REQUIRED" and not approve
        if trigger == "HEM_URGENCY_REQUIRED" and body.get("so_id"):
            await self.advance_idp(body["so_id"], body["idp_id"], "hem_approved" if approve else "hem_denied")
        moment_id = body["moment_id"]

        def settle(s: SessionEntry) -> bool:
            if not any(h.moment_id == moment_id for h in s.hem_queue):
                return False
            s.hem_queue = [h for h in s.hem_queue if h.moment_id != moment_id]
            if ends:
                s.state = "TERMINATED"
            else:
                s.mismatches = []
                if not s.hem_queue and s.state == "HEM_PENDING":
                    s.state = "ACTIVE"
            _mirror(s)
            return True

        scope = body.get("scope")
        if scope:
            await self.update_hold(body["agent"], scope["so_id"], _hold_resolve(moment_id, scope.get("mandate_id") if ends else None))
        return await self.update_session(body["agent"], body["session_id"], settle)


def bump_step(step: int, idp_id: str) -> Any:
    """``update_session`` fn: a committed IDP_SUBMITTED at ``step`` (spec 003 §5.2(f) counts
    committed steps), whatever the session's state; ``last_step`` only grows."""

    def fn(s: SessionEntry) -> bool:
        if s.last_step >= step:
            return False
        s.last_step = step
        s.last_idp = idp_id
        return True

    return fn


def _hem_hold(body: dict[str, Any]) -> HemHold:
    scope = body.get("scope") or {}
    return HemHold(moment_id=body["moment_id"], idp_id=body["idp_id"], session_id=body["session_id"],
                   trigger=body["trigger"], principal=body["principal"],
                   so_id=scope.get("so_id"), mandate_id=scope.get("mandate_id"),
                   mandate_exp=scope.get("mandate_exp") if isinstance(scope.get("mandate_exp"), int | float) else None)


def _mirror(s: SessionEntry) -> None:
    """The hem_* members and the state follow the queue: its head, HEM_PENDING while it holds one."""
    if s.hem_queue:
        h = s.hem_queue[0]
        s.hem_idp_id, s.hem_moment_id, s.hem_trigger, s.hem_principal = h.idp_id, h.moment_id, h.trigger, h.principal
        if s.state == "ACTIVE":
            s.state = "HEM_PENDING"


def _escalate(body: dict[str, Any]) -> Any:
    """``update_session`` fn: queue the moment (spec 003 §5.5.2: a second escalation
    waits behind the first; neither replaces the other). A session already
    TERMINATED stays so; its moment is still answered and logged."""

    def fn(s: SessionEntry) -> bool:
        # The last moment the session settled keeps its id in hem_moment_id: a late
        # repeat of its escalation does not re-open it.
        if s.hem_moment_id == body["moment_id"] or any(h.moment_id == body["moment_id"] for h in s.hem_queue):
            return False
        s.hem_queue.append(_hem_hold(body))
        _mirror(s)
        return True

    return fn


def _hold_add(body: dict[str, Any]) -> Any:
    def fn(h: HoldEntry) -> bool:
        if any(p.moment_id == body["moment_id"] for p in h.pending):
            return False
        h.pending.append(_hem_hold(body))
        return True

    return fn


def _hold_resolve(moment_id: str, ended_mandate: str | None) -> Any:
    def fn(h: HoldEntry) -> bool:
        kept = [p for p in h.pending if p.moment_id != moment_id]
        changed, h.pending = len(kept) != len(h.pending), kept
        if ended_mandate and ended_mandate not in h.terminated:
            h.terminated.append(ended_mandate)
            changed = True
        return changed

    return fn

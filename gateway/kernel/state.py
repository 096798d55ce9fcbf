"""Kernel state: the idp_id index and per-session state, shared by every instance.

Kept in the JetStream KV bucket ``PGW_KERNEL`` (file storage), so every
gateway instance sees the same index and a restart loses nothing. Every
change is a compare-and-set on the entry's revision (``create`` for a new
entry, ``update(last=rev)`` otherwise), so two instances cannot both advance
one session's step_sequence or both record one idp_id.

The event log is the ground truth (spec 003 §8.4: the index is "rebuilt from
the Event Log on kernel restart"): at start ``rebuild`` replays every log
event after the bucket's ``_checkpoint`` and applies it idempotently (status
only moves forward, ``last_step`` is a max, mismatch counts are sets), so a
bucket that lags the log - a crash between the log append and the KV write -
or a bucket that was lost entirely is brought back to what the log says.

Keys:
* ``idp.{so_id}.{idp_id}``  -> ``IdpEntry`` (spec 003 §5.2(c): unique per governed object)
* ``tr.{agent}.{idp_id}``   -> so_id, to find the IDP a transition report names
* ``sess.{digest(agent, session_id)}`` -> ``SessionEntry``
* ``_checkpoint``           -> last log sequence the rebuild applied
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Literal

import msgspec
from msgspec import Struct, field
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyWrongLastSequenceError

from pgwcore.atomic import ERR_WRONG_LAST_SEQ, publish_acked
from pgwcore.kvread import BatchReader, enable_direct, get_last
from pgwcore.logs import get_logger
from pgwcore.streams import ensure_kv
from subjects.errors import PgwError
from subjects.idp import log_event_decoder
from subjects.util import stable_id

log = get_logger("pgw.kernel.state")

BUCKET = "PGW_KERNEL"

IdpStatus = Literal[
    "submitted", "permitted", "denied", "hem_pending", "hem_approved", "hem_denied", "transitioned"
]
# Forward order of an IDP's life; a status never moves backwards.
_RANK = {
    "submitted": 0,
    "permitted": 1,
    "denied": 1,
    "hem_pending": 1,
    "hem_approved": 2,
    "hem_denied": 2,
    "transitioned": 3,
}
SessionState = Literal["ACTIVE", "HEM_PENDING", "TERMINATED"]
HemTrigger = Literal["HEM_URGENCY_REQUIRED", "MISSION_REF_MISMATCH_THRESHOLD", "IDP_COMMITMENT_GAP"]


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


_idp_dec = msgspec.json.Decoder(IdpEntry)
_sess_dec = msgspec.json.Decoder(SessionEntry)
_enc = msgspec.json.Encoder()


def idp_key(so_id: str, idp_id: str) -> str:
    return f"idp.{so_id.lower()}.{idp_id.lower()}"


def tr_key(agent: str, idp_id: str) -> str:
    return f"tr.{agent}.{idp_id.lower()}"


def session_key(agent: str, session_id: str) -> str:
    return f"sess.{stable_id('session', agent, session_id)}"


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

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self.kv: Any = None
        self._sessions: dict[str, tuple[SessionEntry, int]] = {}
        self._batch: BatchReader | None = None

    def _remember(self, s: SessionEntry, rev: int) -> None:
        key = session_key(s.agent, s.session_id)
        self._sessions.pop(key, None)
        if len(self._sessions) >= self.session_cache_size:
            del self._sessions[next(iter(self._sessions))]
        self._sessions[key] = (msgspec.structs.replace(s, mismatches=list(s.mismatches)), rev)

    def cached_session(self, agent: str, session_id: str, step: int) -> tuple[SessionEntry, int] | None:
        """The session as this instance last saw it, if it lets ``step`` go on (ACTIVE, a
        higher step): a copy and its revision, for a compare-and-set; else None (read it)."""
        got = self._sessions.get(session_key(agent, session_id))
        if got is None or got[0].state != "ACTIVE" or got[0].last_step >= step:
            return None
        return msgspec.structs.replace(got[0], mismatches=list(got[0].mismatches)), got[1]

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
    ) -> tuple[tuple[IdpEntry, int] | None, str | None, tuple[SessionEntry, int] | None]:
        """The idp_id's index entry and report key (spec 003 §5.2(c)) and, unless
        ``session_id`` is None, the session (§5.2(f)): one request where the bucket
        allows it, else three reads at once. The same answers as ``idp``, ``so_of``
        and ``session``."""
        if self._batch is None:
            if session_id is None:
                known, reported = await asyncio.gather(self.idp(so_id, idp_id), self.so_of(agent, idp_id))
                return known, reported, None
            return await asyncio.gather(self.idp(so_id, idp_id), self.so_of(agent, idp_id), self.session(agent, session_id))
        keys = [idp_key(so_id, idp_id), tr_key(agent, idp_id)]
        if session_id is not None:
            keys.append(session_key(agent, session_id))
        got = await self._batch.get_many(keys)
        known = (_idp_dec.decode(got[0][0]), got[0][1]) if got[0] else None
        reported = got[1][0].decode() if got[1] else None
        read: tuple[SessionEntry, int] | None = None
        if session_id is not None:
            if got[2] is None:
                read = SessionEntry(agent=agent, session_id=session_id), 0
            else:
                s = _sess_dec.decode(got[2][0])
                self._remember(s, got[2][1])
                read = s, got[2][1]
        return known, reported, read

    # -- reads --------------------------------------------------------------
    async def _get(self, key: str) -> tuple[bytes, int] | None:
        # kv.get's answer (None for a missing, deleted or empty key) at about half
        # its client CPU (pgwcore.kvread); the request and the server's work are the same.
        return await get_last(self.js._nc, self.js._prefix, BUCKET, key, self.js._timeout)

    async def idp(self, so_id: str, idp_id: str) -> tuple[IdpEntry, int] | None:
        got = await self._get(idp_key(so_id, idp_id))
        return (_idp_dec.decode(got[0]), got[1]) if got else None

    async def so_of(self, agent: str, idp_id: str) -> str | None:
        got = await self._get(tr_key(agent, idp_id))
        return got[0].decode() if got else None

    async def session(self, agent: str, session_id: str) -> tuple[SessionEntry, int]:
        got = await self._get(session_key(agent, session_id))
        if got is None:
            return SessionEntry(agent=agent, session_id=session_id), 0
        s = _sess_dec.decode(got[0])
        self._remember(s, got[1])
        return s, got[1]

    # -- compare-and-set writes ----------------------------------------------
    async def _write(self, key: str, value: bytes, rev: int) -> int:
        """``kv.update(key, value, last=rev)`` (rev 0: the key must not exist) through
        ``publish_acked`` (about two thirds of ``kv.update``'s client CPU): the same
        compare-and-set (``Nats-Expected-Last-Subject-Sequence``, checked by the server),
        the new revision, or ``KeyWrongLastSequenceError``."""
        try:
            ack = await publish_acked(self.js._nc, f"$KV.{BUCKET}.{key}", value,
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
                s, rev = msgspec.structs.replace(known[0], mismatches=list(known[0].mismatches)), known[1]
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

    async def escalate(self, body: dict[str, Any]) -> SessionEntry | None:
        """Put the session in HEM_PENDING for the moment of ``body`` (a ``HEM_ESCALATED``
        body); return the session as it was before, for ``unescalate`` (None if it already
        held this moment)."""
        fn = _escalate(body)
        before: list[SessionEntry] = []

        def take(s: SessionEntry) -> bool:
            prior = msgspec.structs.replace(s, mismatches=list(s.mismatches))
            changed = bool(fn(s))
            before[:] = [prior] if changed else []
            return changed

        await self.update_session(body["agent"], body["session_id"], take)
        return before[0] if before else None

    async def unescalate(self, body: dict[str, Any], prior: SessionEntry) -> None:
        """Undo ``escalate`` while the session still holds this moment: its event was never logged."""

        def back(s: SessionEntry) -> bool:
            if s.state != "HEM_PENDING" or s.hem_moment_id != body["moment_id"]:
                return False
            s.state, s.hem_idp_id, s.hem_moment_id = prior.state, prior.hem_idp_id, prior.hem_moment_id
            s.hem_trigger, s.hem_principal = prior.hem_trigger, prior.hem_principal
            return True

        await self.update_session(body["agent"], body["session_id"], back)

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
    async def rebuild(self, js: JetStreamContext, stream: str) -> int:
        """Apply every log event after the checkpoint; return how many were applied."""
        got = await self._get("_checkpoint")
        start = int(got[0]) if got else 0
        info = await js.stream_info(stream)
        last = info.state.last_seq or 0
        if last <= start:
            return 0
        from nats.js.api import ConsumerConfig, DeliverPolicy

        sub = await js.subscribe(
            f"{info.config.subjects[0] if info.config.subjects else '>'}",
            stream=stream,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start + 1),
        )
        applied = 0
        try:
            while True:
                msg = await sub.next_msg(timeout=10)
                seq = msg.metadata.sequence.stream
                try:
                    ev = log_event_decoder.decode(msg.data)
                    await self.apply(ev.event_type, ev.body, seq)
                    applied += 1
                except Exception:
                    log.exception("could not apply log event during rebuild", seq=seq)
                if seq >= last:
                    break
        finally:
            await sub.unsubscribe()
        await self.kv.put("_checkpoint", str(last).encode())
        log.info("kernel state rebuilt from the event log", applied=applied, from_seq=start + 1, to_seq=last)
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
            case "STATE_TRANSITIONED":
                await self.advance_idp(body["so_id"], body["idp_id"], "transitioned", transition_seq=seq)
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
            case "HEM_RESOLVED":
                await self.resolve_hem(body)
            case "TRANSITION_REPORT_OVERDUE":
                await self.mark_overdue(body["so_id"], body["idp_id"], seq)

    async def resolve_hem(self, body: dict[str, Any]) -> SessionEntry:
        """Apply a HEM decision (``HEM_RESOLVED`` body): idempotent by moment id."""
        trigger, decision = body["trigger"], body["decision"]
        approve = decision == "approve"
        if trigger == "HEM_URGENCY_REQUIRED" and body.get("so_id"):
            await self.advance_idp(body["so_id"], body["idp_id"], "hem_approved" if approve else "hem_denied")

        def settle(s: SessionEntry) -> bool:
            if s.hem_moment_id != body["moment_id"] or s.state != "HEM_PENDING":
                return False
            if trigger == "HEM_URGENCY_REQUIRED" or approve:
                s.state = "ACTIVE"
                s.mismatches = []
            else:
                # A commitment gap or repeated mission mismatches that the human
                # did not approve ends the session (spec 003 §5.5.2).
                s.state = "TERMINATED"
            return True

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


def _escalate(body: dict[str, Any]) -> Any:
    def fn(s: SessionEntry) -> bool:
        if s.hem_moment_id == body["moment_id"]:
            return False
        s.state = "HEM_PENDING"
        s.hem_idp_id = body["idp_id"]
        s.hem_moment_id = body["moment_id"]
        s.hem_trigger = body["trigger"]
        s.hem_principal = body["principal"]
        return True

    return fn

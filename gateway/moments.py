"""The moment desk: every binding moment and clarification awaiting a principal.

State lives in the JetStream KV bucket ``PGW_MOMENTS`` under the key
``{principal}.{moment_id}``, so any number of gateway instances share it and
it survives restarts. Transitions use compare-and-set on the KV revision:
the first valid answer wins (DESIGN §4.2), a second one is refused even
after a restart, and a moment expires at most once.

A principal's free text (a free_text answer, a dialogue objection,
clarification answers) is kept in full only ``answer_text_keep_s`` after its
outcome is published (spec 000 §13: not persisted "beyond what the
audit-signal significance predicate requires"; the verdict, and so the
capsule, only ever holds its keyed digest, pgwcore.keys.DigestKey). Forgotten
means gone from the disk too (docs/security.md "Data at rest"): a KV bucket's
stream refuses message deletes, and a superseded revision or a purged key
leaves its bytes in the block file, so the text is never written to
``PGW_MOMENTS``. It is held apart in the stream ``KV_PGW_ANSWER_TEXT`` (one
message per answer, ``{principal}.{moment_id}.{nonce}``, deletes allowed),
the record holds its stream sequence (``text_seq``) and, in the text's place,
``[forgotten (spec 000 §13); hmac-sha256:…]``; a read of the record puts the
text back while it is held. When the window has passed, the instance that
follows the record deletes the outcome message from ``PGW_OUTBOUND`` and the
held text with erase (STREAM.MSG.DELETE overwrites the bytes), then marks the
record ``forgotten``; the moment query answers the markers from then on. A
crash in between leaves the record due, and the next pass erases again (gone
already is fine). An answer that loses the race for the record has its held
text erased at once.

A terminal transition is written first with ``published = False``, then its
messages (outcome, verdict, withdrawn item) are published with deterministic
``Nats-Msg-Id``s, then the record is marked ``published``. A crash in between
leaves a record that any instance's watcher re-drives; the stream drops the
repeats, so the agent hears exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from gateway.moment_list import INDEX_BUCKET, AgentIndex
from gateway.moment_record import (
    AGENT_HEADER,
    STATE_HEADER,
    ApprovalJudge,
    HemCallback,
    HemContext,
    HemInfo,
    MomentRecord,
    Refused,
    closing_outcome,
    closing_verdict,
    created_ms,
    forget_text,
    has_text,
    hem_decision_of,
    moment_key,
    parse_agent,
    parse_state,
    state_header,
)
from pgwcore.keys import DigestKey
from pgwcore.kvread import kv_keys, kv_last_seq
from pgwcore.logs import get_logger
from pgwcore.loop import together
from pgwcore.publish import KvWriter, Publisher
from pgwcore.service import delivery
from pgwcore.streams import ensure_kv, ensure_stream
from subjects.names import Subjects
from subjects.util import now_rfc3339, stable_id, to_rfc3339
from subjects.wire import (
    BindingMoment,
    BindingMomentItem,
    ClarificationAnswers,
    ClarificationItem,
    ClarificationQuestion,
    DialogueVeto,
    FreeTextAnswer,
    OptionChoice,
    Resolution,
    ResolveReply,
    SurfaceItem,
    Verdict,
    WithdrawnItem,
)

if TYPE_CHECKING:
    from nats.aio.msg import Msg

log = get_logger("pgw.moments")

BUCKET = "PGW_MOMENTS"
_PRE = f"$KV.{BUCKET}."  # the bucket's subjects, as KvWriter writes them
MOMENT_TTL_S = 30 * 86400.0
# The principal's free text, held apart until it is forgotten (the module docstring).
TEXT_BUCKET = "PGW_ANSWER_TEXT"
TEXT_STREAM = f"KV_{TEXT_BUCKET}"
_TEXT_PRE = f"$KV.{TEXT_BUCKET}."


_dec = msgspec.json.Decoder(MomentRecord)


def _record(value: bytes, key: str) -> MomentRecord | None:
    """The desk's record stored under ``key``, or None for bytes the desk did not write.

    A bucket's keys are subjects: a write the desk did not make can land there (the server's own
    publish acknowledgement, sent to whatever reply subject a publisher names: docs/security.md
    "Replies"). Such a value is not a moment: it is skipped and logged, and never fails a
    principal's pending list or an agent's query for the moments around it."""
    try:
        return _dec.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError):
        log.warning("a PGW_MOMENTS value is not a moment record; skipped", key=key[:200], size=len(value))
        return None
_res_dec = msgspec.json.Decoder(Resolution)
HELD_FOR = "Pgw-Agent"  # on a held text: the agent its outcome went to (MomentDesk._forget_apart)
HELD_SCAN = 16  # the most messages read under one moment's key (one answer holds one; a lost race, one more)
_enc = msgspec.json.Encoder()


def text_stream_config() -> StreamConfig:
    """``KV_PGW_ANSWER_TEXT``: laid out as a KV bucket (so ``$KV.`` writes reach it), but message
    deletes allowed, which a bucket made by the KV API refuses and cannot be changed to allow."""
    return StreamConfig(
        name=TEXT_STREAM, subjects=["$KV.PGW_ANSWER_TEXT.>"], storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD, max_msgs_per_subject=1,
        max_age=MOMENT_TTL_S, allow_direct=True, deny_delete=False, deny_purge=False,
    )


class MomentDesk:
    """Dispatch, resolve and expire moments; shared state in KV."""

    def __init__(self, js: JetStreamContext, subjects: Subjects, publisher: Publisher,
                 answer_text_keep_s: float = 3600.0, digests: DigestKey | None = None) -> None:
        self.js = js
        self.answer_text_keep_s = answer_text_keep_s
        # The deployment's digest key (pgwcore.keys); without one, a key of this process alone.
        self.digests = digests or DigestKey.ephemeral()
        self.subjects = subjects
        self.publisher = publisher
        self.kv: Any = None
        self._writer: Any = None
        # The agents' index of their moments (gateway.moment_list), derived from the writes the watcher follows.
        self.agents = AgentIndex()
        self._followed = 0  # the stream sequence of the last write of the bucket the watcher has handled
        self._catching_up: list[tuple[int, asyncio.Future[None]]] = []
        self._hem_callbacks: list[HemCallback] = []
        self._judge: ApprovalJudge | None = None
        self._resolved_callbacks: list[Callable[[MomentRecord], Awaitable[None]]] = []
        self._heap: list[tuple[float, str]] = []
        self._apart: dict[str, float] = {}  # keys whose held texts are due without a record of the desk's
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._watcher: Any = None
        self._text_watcher: Any = None
        self._sweeping: dict[str, bool] = {}  # moment keys whose held texts are being read: whether to read again
        self._closing = False

    # -- life cycle -------------------------------------------------------
    async def start(self) -> None:
        self.kv = await ensure_kv(self.js, BUCKET, ttl=MOMENT_TTL_S, atomic=True)
        await ensure_stream(self.js, text_stream_config())
        self._writer = KvWriter(self.js, self.kv, BUCKET)  # dispatch's creates, group-committed
        # The index the previous version wrote per moment: still read for its entries, no longer written.
        await ensure_kv(self.js, INDEX_BUCKET, ttl=MOMENT_TTL_S, atomic=True)
        # Every record, the latest of each key first, then each write as it is
        # stored, handled in the subscription's own callback: nats' KeyWatcher
        # would cost a task, a timer and a uuid per record on the hot path.
        # Headers only: the desk's writes carry what the watch needs
        # (``state_header``), so an instance does not receive and decode every
        # moment in full (issue 18: that made each added instance cost ~35 µs per
        # KB of every moment); a record written without it is read on demand.
        self._watcher = await self.js.subscribe(
            f"{_PRE}>", stream=f"KV_{BUCKET}", cb=self._on_record, ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, inactive_threshold=300.0, headers_only=True,
        )
        # The held texts' stream, headers only (the desk's own writes carry HELD_FOR and cost nothing more): a
        # message under a moment's key that the desk did not write, a party's acknowledgement aimed there
        # (docs/security.md "Replies"), is read and erased when it is no answer of hers, whenever it lands
        # (``_sweep_text``). Before, only a pass over the key's texts (a foreign record, the texts' due time)
        # erased it, so one landing after her words were forgotten stayed (found by a loaded run of the suite).
        self._text_watcher = await self.js.subscribe(
            f"{_TEXT_PRE}>", stream=TEXT_STREAM, cb=self._on_text, ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL, inactive_threshold=300.0, headers_only=True,
        )
        # Appended: the watches' callbacks may have started tasks of their own meanwhile, which close() ends too.
        self._tasks.append(asyncio.create_task(self._expiry_loop(), name="moments-expiry"))

    async def close(self) -> None:
        self._closing = True
        for watcher in (self._watcher, self._text_watcher):
            if watcher is not None:
                with contextlib.suppress(Exception):
                    await watcher.unsubscribe()
        tasks, self._tasks = list(self._tasks), []
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def on_hem_decision(self, callback: HemCallback) -> None:
        self._hem_callbacks.append(callback)

    def judge_approval(self, judge: ApprovalJudge) -> None:
        """``judge(record)``: why her approval of the step a HEM moment gates permits nothing now (the kernel:
        its mandate revoked, expired or ended), or None. Asked once, as she approves, and stored in the same write
        as her answer, so the agent's outcome, the moment query and the kernel's log all read one judgement."""
        self._judge = judge

    def on_resolved(self, callback: Callable[[MomentRecord], Awaitable[None]]) -> None:
        """Called once a principal's answer is published (dual veto, spec 000 §7.2; rates §12.2)."""
        self._resolved_callbacks.append(callback)

    # -- dispatch ---------------------------------------------------------
    async def dispatch(
        self,
        *,
        agent: str,
        principal: str,
        binding_moment: BindingMoment | None = None,
        questions: list[ClarificationQuestion] | None = None,
        context_type: str | None = None,
        envelope_id: str,
        correlation_id: str,
        untrusted: bool = False,
        expires_in_s: int | None = None,
        traceparent: str | None = None,
        hem: HemContext | None = None,
        moment_id: str | None = None,
        action_type: str = "pgw.binding_moment",
        details: dict[str, Any] | None = None,
        node_id: str | None = None,
        conventional: Any = None,
    ) -> str:
        """Store the moment, publish its surface item and the hitl_dispatched verdict.

        Idempotent for one ``moment_id``: a redelivered input republishes the
        same messages (dropped by the stream) and never re-opens a closed moment.
        """
        moment_id = moment_id or stable_id("moment", agent, envelope_id)
        now = time.time()
        expires_at = now + expires_in_s if expires_in_s else None
        created_at = to_rfc3339(now)
        common = dict(
            agent=agent,
            principal=principal,
            created_at=created_at,
            untrusted=untrusted,
            traceparent=traceparent,
            moment_id=moment_id,
            envelope_id=envelope_id,
            correlation_id=correlation_id,
            expires_at=to_rfc3339(expires_at) if expires_at else None,
            node_id=node_id,
        )
        item: SurfaceItem
        if binding_moment is not None:
            item = BindingMomentItem(binding_moment=binding_moment, hem=hem is not None, conventional=conventional,
                                     **common)
        else:
            item = ClarificationItem(questions=questions or [], context_type=context_type, **common)
        record = MomentRecord(
            moment_id=moment_id,
            agent=agent,
            principal=principal,
            envelope_id=envelope_id,
            correlation_id=correlation_id,
            item=item,
            dispatch_verdict_id=stable_id("dispatch", moment_id),
            created_at=now,
            expires_at=expires_at,
            untrusted=untrusted,
            hem=HemInfo(hem.idp_id, hem.session_id, hem.action, hem.permits) if hem else None,
            traceparent=traceparent,
            node_id=node_id,
        )
        key = moment_key(principal, moment_id)
        try:
            await self._writer.create(key, _enc.encode(record), self._header(record))
        except KeyWrongLastSequenceError:
            record = _dec.decode((await self.kv.get(key)).value)
        # Independent durable writes: in flight together, both acked before we return.
        verdict = self.publisher.verdict(
            Verdict(
                verdict_id=record.dispatch_verdict_id,
                verdict_class="hitl_dispatched",
                decision="needs_input",
                approver="policy",
                human_disposed=False,
                ts=created_at if record.created_at == now else to_rfc3339(record.created_at),
                agent=agent,
                principal=principal,
                action_type="idp.hem" if hem else action_type,
                action_id=moment_id,
                envelope_id=envelope_id,
                correlation_id=correlation_id,
                moment_id=moment_id,
                idp_id=hem.idp_id if hem else None,
                untrusted=untrusted,
                traceparent=traceparent,
                node_id=record.node_id,
                details=details or {},
            )
        )
        # No index write: the agents' index is derived from the record's write (its Pgw-Moment-Agent header).
        if record.status == "pending":
            await together(self.publisher.surface(record.item, f"item:{moment_id}"), verdict)
        else:
            await verdict
        return moment_id

    def _forget_at(self, rec: MomentRecord) -> float | None:
        """When ``rec``'s free text is to be forgotten (spec 000 §13), or None if it holds none to forget."""
        if rec.status != "resolved" or not rec.published or rec.forgotten or not has_text(rec.resolution):
            return None
        return (rec.resolved_at or rec.created_at) + self.answer_text_keep_s

    def _header(self, rec: MomentRecord) -> dict[str, str]:
        return state_header(rec, self._forget_at(rec))

    async def caught_up(self, timeout: float = 3.0) -> bool:
        """Wait until the watcher has handled every write of the bucket stored before this call; False on timeout.

        The moment list reads the derived index (gateway.moment_list) only then, so a moment
        stored (by any instance) before the query is in it, as when the index was its own write.
        """
        # The bucket's last record, not the stream's last message (pgwcore.kvread.kv_last_seq): one stored
        # under another subject never reaches the watcher, and each moment list waited for it until its timeout.
        target = await kv_last_seq(self.js, BUCKET)
        if self._followed >= target:
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (target, fut)
        self._catching_up.append(entry)
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with contextlib.suppress(ValueError):
                self._catching_up.remove(entry)

    def _followed_to(self, msg: Msg) -> None:
        try:
            seq = delivery(msg)[0]  # the reply subject read without nats' full metadata (a datetime per write)
        except Exception:  # noqa: BLE001 - no metadata (not a stream delivery): nothing to record
            return
        if seq <= self._followed:
            return
        self._followed = seq
        for target, fut in self._catching_up:
            if target <= seq and not fut.done():
                fut.set_result(None)

    # -- queries ----------------------------------------------------------
    async def get(self, principal: str, moment_id: str, *, hydrate: bool = True) -> tuple[MomentRecord, int] | None:
        """The record and its revision; ``hydrate``: with the held free text put back in its place."""
        try:
            entry = await self.kv.get(moment_key(principal, moment_id))
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        rec = _record(entry.value, entry.key)
        if rec is None:
            return None
        if hydrate:
            await self._hydrate(rec)
        return rec, entry.revision

    # -- the principal's free text, held apart (the module docstring) --------------
    async def _hydrate(self, rec: MomentRecord) -> None:
        """Put the held text back into ``rec.resolution``; gone (forgotten, aged out) leaves the markers."""
        if rec.text_seq is None or rec.forgotten:
            return
        try:
            msg = await self.js.get_msg(TEXT_STREAM, rec.text_seq)
            rec.resolution = _res_dec.decode(msg.data or b"")
        except (APIError, msgspec.DecodeError, msgspec.ValidationError):
            log.warning("held answer text unreadable; the record's digests stand for it", moment_id=rec.moment_id)

    async def _hold(self, principal: str, moment_id: str, resolution: Resolution, agent: str) -> int:
        """Store ``resolution`` (it holds free text) apart; its stream sequence. It names the agent its outcome
        goes to, so it is forgotten with that outcome even where its record is gone (``_forget_apart``)."""
        subject = f"{_TEXT_PRE}{moment_key(principal, moment_id)}.{secrets.token_hex(8)}"
        ack = await self.js.publish(subject, _enc.encode(resolution), stream=TEXT_STREAM, headers={HELD_FOR: agent})
        return ack.seq

    async def _held_apart(self, key: str) -> list[Any]:
        """The held texts of moment record ``key`` (``{principal}.{moment_id}``), oldest first: at most
        ``HELD_SCAN`` messages read. A message there that the desk did not write (no ``HELD_FOR`` header: a
        party's acknowledgement aimed at the subject, docs/security.md "Replies", or a text held before the
        header existed, which a record names) is left out, and erased when it is no answer of hers."""
        out: list[Any] = []
        seq = 1
        for _ in range(HELD_SCAN):
            try:
                msg = await self.js.get_msg(TEXT_STREAM, seq=seq, subject=f"{_TEXT_PRE}{key}.*", next=True)
            except (NotFoundError, APIError):
                break
            seq = (msg.seq or seq) + 1
            if (msg.headers or {}).get(HELD_FOR):
                out.append(msg)
                continue
            try:
                _res_dec.decode(msg.data or b"")
            except (msgspec.DecodeError, msgspec.ValidationError):
                await self._erase(msg.seq)  # no answer of hers: nothing to keep, nothing to schedule again
        return out

    async def _on_text(self, msg: Msg) -> None:
        """A message stored among the held texts (headers only): one the desk did not write under a moment's key
        (``{principal}.{moment_id}.{token}``; the gate's arguments, ``gate.{key}``, are the kernel's) has its
        key's texts read, and what is no answer of hers erased (``_held_apart``)."""
        if self._closing or (msg.headers or {}).get(HELD_FOR):
            return
        parts = msg.subject[len(_TEXT_PRE):].split(".")
        if len(parts) != 3:
            return
        key = f"{parts[0]}.{parts[1]}"
        if key in self._sweeping:
            self._sweeping[key] = True  # landed while the key is read: read it again after
            return
        self._sweeping[key] = False
        task = asyncio.create_task(self._sweep_text(key))
        self._tasks.append(task)
        task.add_done_callback(self._task_done)

    async def _sweep_text(self, key: str) -> None:
        try:
            while True:
                await self._held_apart(key)
                if not self._sweeping.get(key):
                    return
                self._sweeping[key] = False
        except Exception:  # logged; the next message under the key, or its texts' due time, reads it again
            log.exception("could not read a moment's held texts", key=key)
        finally:
            self._sweeping.pop(key, None)

    async def _schedule_apart(self, key: str) -> None:
        """A record that is not the desk's (a party's publish acknowledgement aimed at its key, docs/security.md
        "Replies") says nothing of when its answer's text is due: the key's held texts are due
        ``answer_text_keep_s`` after they were stored (when she answered), whatever the record holds. Before,
        such a record kept the text and the agent's outcome on disk for good (found by an attack from the docs).
        One entry per key, at its earliest due text, however many writes are aimed at the record (a review:
        each write scheduled each text again)."""
        if key in self._apart:
            return
        held = await self._held_apart(key)
        if held:
            self._schedule(key, min(self._held_due(m) for m in held))

    def _held_due(self, msg: Any) -> float:
        """When held text ``msg`` is to be forgotten: ``answer_text_keep_s`` after it was stored."""
        return (msg.time.timestamp() if msg.time else 0.0) + self.answer_text_keep_s

    def _schedule(self, key: str, due: float) -> None:
        self._apart[key] = due
        heapq.heappush(self._heap, (due, key))
        self._wake.set()

    async def _forget_apart(self, key: str) -> None:
        """Forget the held texts of ``key`` that are due, and their outcomes, without the record (gone or not the
        desk's): the same erases ``_forget`` makes from a record; the next text of the key not yet due is
        scheduled."""
        self._apart.pop(key, None)
        mid = key.partition(".")[2]
        later: list[float] = []
        for msg in await self._held_apart(key):
            due = self._held_due(msg)
            if due > time.time():
                later.append(due)
                continue
            agent = msg.headers.get(HELD_FOR)
            await self._delete_outcome(agent, mid, due - self.answer_text_keep_s)
            await self._erase(msg.seq)
            log.info("principal's free text forgotten without its record", moment_id=mid, agent=agent)
        if later:
            self._schedule(key, min(later))

    async def _erase(self, seq: int) -> None:
        """Delete held text ``seq`` with erase (STREAM.MSG.DELETE without no_erase overwrites the bytes)."""
        try:
            await self.js.delete_msg(TEXT_STREAM, seq)
        except APIError as e:  # gone already (an earlier pass, another instance): nothing to erase
            log.debug("held answer text already gone", seq=seq, error=str(e))

    def _stored(self, rec: MomentRecord) -> bytes:
        """What the bucket keeps of ``rec``: the keyed digests in place of text held apart, never the text."""
        if rec.text_seq is not None and not rec.forgotten and rec.resolution is not None:
            rec = msgspec.structs.replace(rec, resolution=forget_text(rec.resolution, self.digests))
        return _enc.encode(rec)

    async def find(self, agent: str, moment_id: str, principal: str | None = None) -> MomentRecord | None:
        """``agent``'s moment ``moment_id`` (the moment query, subjects/momentquery.py), else None.

        With ``principal`` one read; without it the key is found in the server's
        per-subject index of the bucket's stream (as ``pending`` does). A moment of
        another agent is None, like one that does not exist (no existence oracle).
        """
        if principal is None:
            info = await self.js.stream_info(f"KV_{BUCKET}", subjects_filter=f"{_PRE}*.{moment_id}")
            keys = [subject[len(_PRE):] for subject in (info.state.subjects or {})]
        else:
            keys = [moment_key(principal, moment_id)]
        for key in keys:
            value = await self._value(key)
            rec = _record(value, key) if value else None
            if rec is not None and rec.agent == agent and rec.moment_id == moment_id:
                await self._hydrate(rec)
                return rec
        return None

    async def pending(self, principal: str) -> list[SurfaceItem]:
        """Items still awaiting ``principal``, oldest first.

        The keys come from the server's per-subject index (``kv_keys``), not
        from a KV watcher, which made a late surface miss a pending moment
        under load.
        """
        now = time.time()
        keys = await kv_keys(self.js, BUCKET, f"{principal}.*")
        values = await asyncio.gather(*(self._value(k) for k in keys))
        records = [
            rec
            for rec in (_record(v, k) for k, v in zip(keys, values, strict=True) if v)
            if rec is not None and rec.status == "pending" and not (rec.expires_at and rec.expires_at <= now)
        ]
        records.sort(key=lambda r: r.created_at)
        return [r.item for r in records]

    async def _value(self, key: str) -> bytes | None:
        try:
            return (await self.kv.get(key)).value
        except KeyNotFoundError:  # deleted or expired since the listing
            return None

    # -- resolution -------------------------------------------------------
    async def resolve(self, principal: str, moment_id: str, resolution: Resolution) -> ResolveReply:
        """Check and record the principal's answer; first valid answer wins."""
        for _ in range(5):
            found = await self.get(principal, moment_id)
            if found is None:
                # Unknown and foreign moments look the same: no existence oracle.
                raise Refused("unknown_moment", "no such moment for this principal")
            rec, rev = found
            if rec.status == "resolved":
                if rec.resolution == resolution and not rec.published:
                    await self._publish_final(rec, rev)
                raise Refused("already_resolved", "this moment was already answered")
            if rec.status == "expired" or (rec.expires_at and rec.expires_at <= time.time()):
                raise Refused("expired", "this moment expired before it was answered")
            self._check(rec, resolution)
            if rec.hem is not None and rec.hem.permits and self._judge is not None \
                    and hem_decision_of(resolution) == "approve":
                try:
                    rec.void = await self._judge(rec)
                except Exception:  # not judged: the kernel judges it as it applies her answer, as before
                    log.exception("could not judge an approval as it was given", moment_id=moment_id)
            held = await self._hold(principal, moment_id, resolution, rec.agent) if has_text(resolution) else None
            rec.status = "resolved"
            rec.resolution = resolution
            rec.text_seq = held
            rec.resolved_at = time.time()
            rec.published = False
            try:
                rev = await self._writer.update(moment_key(principal, moment_id), self._stored(rec), rev,
                                                self._header(rec))
            except KeyWrongLastSequenceError:
                if held is not None:
                    await self._erase(held)  # this answer lost: its text is kept nowhere
                continue  # someone else changed it; re-read and decide again
            await self._publish_final(rec, rev)
            # The answer as recorded (SR-1 redacted by the caller): what a surface may echo.
            return ResolveReply(status="accepted", moment_id=moment_id, resolution=resolution)
        raise Refused("conflict", "the moment changed concurrently; try again")

    def _check(self, rec: MomentRecord, resolution: Resolution) -> None:
        item = rec.item
        if isinstance(item, ClarificationItem):
            if not isinstance(resolution, ClarificationAnswers):
                raise Refused("wrong_resolution_kind", "a clarification is answered with 'answers'")
            known = {q.id for q in item.questions}
            unknown = sorted(set(resolution.answers) - known)
            if unknown:
                raise Refused("unknown_question", f"no question with id {unknown[0]!r}")
            return
        assert isinstance(item, BindingMomentItem)
        q = item.binding_moment.question
        match resolution:
            case OptionChoice(index=i):
                if i >= len(q.options):
                    raise Refused("index_out_of_range", f"option index {i} is not in 0..{len(q.options) - 1}")
            case FreeTextAnswer():
                if not q.hatches.free_text:
                    raise Refused("hatch_closed", "the answer-space hatch (free_text) is closed for this moment")
            case DialogueVeto():
                if not q.hatches.dialogue:
                    raise Refused("hatch_closed", "the question-space hatch (dialogue) is closed for this moment")
            case ClarificationAnswers():
                raise Refused("wrong_resolution_kind", "a binding moment is answered with option, free_text or dialogue")
        # DESIGN §3.2 step 7, spec 002 "Trust boundary": an untrusted moment
        # cannot advance an approval gate.
        if rec.untrusted and rec.hem is not None:
            raise Refused(
                "untrusted_content_blocks_approval",
                "this moment carries untrusted content and cannot approve the action it gates",
            )

    # -- terminal messages ----------------------------------------------------
    async def _publish_final(self, rec: MomentRecord, rev: int) -> None:
        mid = rec.moment_id
        ts = to_rfc3339(rec.resolved_at or time.time())
        if rec.status == "resolved":
            res = rec.resolution
            assert res is not None
            decision = hem_decision_of(res) if rec.hem else None
            # A HEM moment is an approval gate; an agent's moment is accepted unless its frame is rejected.
            accept = decision == "approve" if rec.hem else not isinstance(res, DialogueVeto)
            text = getattr(res, "text", None) or getattr(res, "objection", None)
            verdict = closing_verdict(
                rec,
                ts,
                "resolved",
                decision="accept" if accept else "reject",
                approver="human",
                human_disposed=True,
                resolution_kind=res.__struct_config__.tag,  # type: ignore[arg-type]
                option_index=res.index if isinstance(res, OptionChoice) else None,
                # spec 000 §13: free-form answers are not persisted beyond need;
                # the verdict (and so the public capsule) keeps only a digest.
                text_digest=self.digests.digest(text) if text else None,
            )
            withdrawn_reason: Literal["resolved", "expired"] = "resolved"
        else:
            decision = "expired"
            # DESIGN §6: a timeout is a refusal, never a consent. Spec 004 §5.4.1: the decision timed
            # out ("timeout"); "expired" is the TTL of a deferral's expiry_policy, which a moment has not.
            verdict = closing_verdict(rec, ts, "timeout", decision="reject", approver="policy", human_disposed=False)
            withdrawn_reason = "expired"
        withdrawn = WithdrawnItem(
            agent=rec.agent, principal=rec.principal, created_at=ts, untrusted=rec.untrusted,
            traceparent=rec.traceparent, moment_id=mid, reason=withdrawn_reason,
        )
        # Spec 004 §5.4.2 pairing rule: a HEM approval that permits the gated step is not a closure
        # of its own ("resolved" is the non-executing closure only); like a kernel PERMIT it is no
        # verdict. The step's execution (or the overdue timeout) supersedes the dispatch, once.
        permit = bool(rec.hem and rec.hem.permits and decision == "approve")
        await asyncio.gather(
            self.publisher.outcome(closing_outcome(rec), f"final:{mid}"),
            *(() if permit else (self.publisher.verdict(verdict),)),
            self.publisher.surface(withdrawn, f"withdrawn:{mid}"),
        )
        if rec.hem:
            for cb in self._hem_callbacks:
                await cb(rec, decision or "expired", rec.resolution)
        if rec.status == "resolved":
            for rcb in self._resolved_callbacks:
                try:
                    await rcb(rec)
                except Exception:
                    log.exception("on_resolved hook failed", moment_id=mid)
        rec.published = True
        with contextlib.suppress(KeyWrongLastSequenceError):
            await self._writer.update(moment_key(rec.principal, mid), self._stored(rec), rev, self._header(rec))

    # -- expiry and re-drive ------------------------------------------------
    async def _on_record(self, msg: Msg) -> None:
        """Track pending expiries, re-drive unpublished terminal records, index the agents' moments (headers only)."""
        try:
            self._on_write(msg)
        finally:
            self._followed_to(msg)

    def _on_write(self, msg: Msg) -> None:
        headers = msg.headers or {}
        if self._closing or "KV-Operation" in headers:
            return  # a delete or purge marker
        key = msg.subject[len(_PRE):]
        owner = parse_agent(headers[AGENT_HEADER]) if AGENT_HEADER in headers else None
        if owner is not None:
            principal, _, mid = key.partition(".")
            self.agents.add(owner[1], owner[0], principal, mid)
        state = parse_state(headers[STATE_HEADER]) if STATE_HEADER in headers else None
        if state is None:  # written by something else than the desk: read it
            task = asyncio.create_task(self._follow(key))
            self._tasks.append(task)
            task.add_done_callback(self._task_done)
            return
        self._track(key, *state)

    def _track(self, key: str, status: str, expires_at: float | None, published: bool,
               forget_at: float | None = None) -> None:
        if forget_at is not None and status == "resolved" and published:
            heapq.heappush(self._heap, (forget_at, key))  # spec 000 §13 (the module docstring)
            self._wake.set()
        if status == "pending" and expires_at:
            heapq.heappush(self._heap, (expires_at, key))
            self._wake.set()
        elif status != "pending" and not published:
            # Give the instance that wrote it a moment to finish, then re-drive.
            asyncio.get_running_loop().call_later(2.0, self._redrive_soon, key)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)

    async def _follow(self, key: str) -> None:
        principal, _, mid = key.partition(".")
        try:
            found = await self.get(principal, mid)
        except msgspec.DecodeError:
            log.warning("undecodable moment record", key=key)
            return
        except Exception:  # logged; the next write of the key is followed again
            log.exception("could not read a moment record", key=key)
            return
        if found is not None:
            rec = found[0]
            self.agents.add(rec.agent, created_ms(rec), rec.principal, rec.moment_id)
            self._track(key, rec.status, rec.expires_at, rec.published, self._forget_at(rec))
        else:
            await self._schedule_apart(key)

    def _redrive_soon(self, key: str) -> None:
        if not self._closing:
            task = asyncio.create_task(self._redrive(key))
            self._tasks.append(task)
            task.add_done_callback(self._task_done)

    async def _redrive(self, key: str) -> None:
        principal, _, mid = key.partition(".")
        found = await self.get(principal, mid)
        if found and found[0].status != "pending" and not found[0].published:
            log.info("re-driving unpublished moment outcome", moment_id=mid, traceparent=found[0].traceparent)
            await self._publish_final(*found)

    async def _expiry_loop(self) -> None:
        while not self._closing:
            now = time.time()
            while self._heap and self._heap[0][0] <= now:
                _, key = heapq.heappop(self._heap)
                try:
                    await self._expire(key)
                except Exception:
                    log.exception("expiry failed", key=key)
            timeout = (self._heap[0][0] - now) if self._heap else 3600.0
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(0.01, timeout))

    async def _expire(self, key: str) -> None:
        principal, _, mid = key.partition(".")
        found = await self.get(principal, mid)
        if not found:
            await self._forget_apart(key)
            return
        rec, rev = found
        if rec.status == "resolved":
            await self._forget(key, rec)
            return
        if rec.status != "pending" or not rec.expires_at or rec.expires_at > time.time():
            return
        rec.status = "expired"
        rec.resolved_at = rec.expires_at
        rec.published = False
        try:
            rev = await self._writer.update(key, self._stored(rec), rev, self._header(rec))
        except KeyWrongLastSequenceError:
            return  # answered or expired by another instance first
        log.info("moment expired", moment_id=mid, agent=rec.agent, traceparent=rec.traceparent)
        await self._publish_final(rec, rev)

    async def _forget(self, key: str, rec: MomentRecord) -> None:
        """Forget the principal's free text of ``rec`` once its time has come (spec 000 §13)."""
        forget_at = self._forget_at(rec)
        if forget_at is None or forget_at > time.time():
            return
        await self._delete_outcome(rec.agent, rec.moment_id, rec.resolved_at or rec.created_at, rec.created_at)
        principal, _, mid = key.partition(".")
        found = await self.get(principal, mid, hydrate=False)  # the record as stored: its markers
        if found is None or found[0].forgotten:
            return
        stored, rev = found
        if stored.text_seq is not None:
            await self._erase(stored.text_seq)  # first: a crash after it leaves the record due, and erased again
        else:  # written before the text was held apart: its revisions in the block file are the limit
            stored.resolution = forget_text(stored.resolution, self.digests)  # type: ignore[arg-type]
        stored.forgotten = True
        with contextlib.suppress(KeyWrongLastSequenceError):  # another instance did it first
            await self._writer.update(key, self._stored(stored), rev, self._header(stored))
            log.info("principal's free text forgotten", moment_id=rec.moment_id, agent=rec.agent)

    async def _delete_outcome(self, agent: str, moment_id: str, resolved_at: float, created_at: float = 0.0) -> None:
        """Delete the closing outcome (``final:{moment_id}``) of a moment from ``PGW_OUTBOUND``.

        Found by its ``Nats-Msg-Id`` among the agent's outcomes stored since just before the
        moment was resolved, headers only; gone already (an earlier pass) is fine.
        """
        from nats.js.api import ConsumerConfig

        want = f"final:{moment_id}"
        start = to_rfc3339(max(created_at, resolved_at - 5.0))
        sub = await self.js.subscribe(
            self.subjects.outcome(agent), stream="PGW_OUTBOUND", ordered_consumer=True, headers_only=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start),
        )
        try:
            for _ in range(100_000):
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except TimeoutError:
                    return  # read to the end: not there (deleted before, or aged out)
                if (msg.headers or {}).get("Nats-Msg-Id") == want:
                    with contextlib.suppress(Exception):  # already deleted by another instance
                        await self.js.delete_msg("PGW_OUTBOUND", msg.metadata.sequence.stream)
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


__all__ = ["HemContext", "MomentDesk", "MomentRecord", "Refused", "hem_decision_of", "now_rfc3339"]

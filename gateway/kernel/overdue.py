"""Every permit is closed by a verdict: a PERMIT whose transition report never comes times out.

A kernel PERMIT (Cedar, or a human's approval through HEM) yields its
verdict only when the agent reports the transition (spec 003 §5.5). An agent
that crashes, or never reports, would leave the permit without a capsule,
and spec 004 §5.4.3 wants a capsule for every verdict, timeouts included.

So each permit is registered as open before the PERMIT answer leaves the
kernel, and the report closes it:

* a Cedar PERMIT (``kernel.log_permits``, the default) by its
  ``CEDAR_PERMIT_RECORDED`` event alone, which is stored before the answer
  anyway (issue 18: one synced write less per PERMIT); the sweep reads these
  events from the log, from the position ``_permit_sweep`` (in
  ``PGW_KERNEL``) on, up to the first one younger than the deadline;
* a HEM approval, or any permit when ``log_permits`` is off, by a key in the
  KV bucket ``PGW_KERNEL_OPEN`` (one per IDP), deleted by its report.

A sweep on every gateway (``kernel.report_deadline_s``, checked at a quarter
of that, at most every 30 s) takes the permits still open past their
deadline (not reported, and not closed before: the index entry's
``overdue_seq``), and for each:

* logs ``TRANSITION_REPORT_OVERDUE`` (signed, chained; deterministic
  ``Nats-Msg-Id``, so two gateways sweeping at once log it once);
* publishes a ``timeout`` verdict (spec 004 §5.4.1 ``timeout``, "a timeout
  before dispatch" as far as the gateway saw: no effect is claimed, so the
  capsule's effect_mode is ``not_applicable``) with the reason
  ``TRANSITION_REPORT_MISSING``; its id is deterministic too;
* records the event's sequence in the index entry (``overdue_seq``; the
  rebuild from the log does the same), so a sweep that reads the same
  permit again, from a position another gateway wrote back or after a lost
  bucket, never closes it twice; and deletes the key, if it has one.

The log position: a kernel that finds no ``_permit_sweep`` in a bucket that
has a rebuild checkpoint (a kernel from before this scheme, whose permits
have KV keys) starts it at the log's head; in a new or lost bucket it starts
at 0, after the rebuild has marked every permit the log shows closed. Only
after the rebuild does the log pass run.

A report that arrives after the deadline is still verified and logged, and
yields its own ``executed`` (or ``errored``) verdict: the trail then holds
both, each true when it was written.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from pgwcore.atomic import publish_acked
from pgwcore.kvread import listing, sweep_markers
from pgwcore.logs import get_logger
from pgwcore.streams import ensure_kv
from subjects.idp import log_event_decoder
from subjects.util import now_rfc3339, parse_rfc3339, stable_id
from subjects.wire import Refusal, ReportedEffect, Verdict

log = get_logger("pgw.kernel.overdue")

BUCKET = "PGW_KERNEL_OPEN"
EVENT = "TRANSITION_REPORT_OVERDUE"
PERMIT_EVENT = "CEDAR_PERMIT_RECORDED"
POSITION_KEY = "_permit_sweep"  # in PGW_KERNEL: the last log sequence the log pass has swept
LOG_STREAM = "PGW_EVENTLOG"


class OpenPermit(msgspec.Struct, kw_only=True):
    so_id: str
    idp_id: str
    agent: str
    principal: str
    session_id: str
    requested_action: str
    submitted_seq: int
    deadline_at: float
    moment_id: str | None = None


def _key(so_id: str, idp_id: str) -> str:
    return stable_id("open-permit", so_id.lower(), idp_id.lower())


class OverdueReports:
    """Open permits and their deadline sweep (a kernel part)."""

    def __init__(self, kernel: Any, deadline_s: float) -> None:
        self.kernel = kernel
        self.deadline_s = deadline_s
        self.kv: Any = None
        self._task: asyncio.Task[None] | None = None
        self._stop_loop = False
        self.log_ready = False  # the log pass waits for the kernel's rebuild (start)
        # The position this process last swept to (or read as the kernel's). A value in the bucket that is no
        # position (an acknowledgement aimed at the key, docs/security.md "Replies") reads as 0; the pass then
        # starts here, not over every permit the log ever recorded: one publish of an agent's had made
        # each sweep read them all again (and an index entry for each).
        self.swept_to = 0
        self.read_events = 0  # log events the log pass has read (tests)

    async def start(self) -> None:
        """Open the bucket and place the log position; call after ``state.open`` and before the rebuild."""
        self.kv = await ensure_kv(self.kernel.js, BUCKET)
        st = self.kernel.state
        if await st._get(POSITION_KEY) is None:
            upgraded = await st._get("_checkpoint") is not None
            head = 0
            if upgraded:
                info = await self.kernel.js.stream_info(LOG_STREAM)
                head = info.state.last_seq or 0
            with contextlib.suppress(KeyWrongLastSequenceError):
                await st.kv.create(POSITION_KEY, str(head).encode())
        if self.deadline_s > 0:
            self._stop_loop = False
            self._task = asyncio.create_task(self._loop(), name="kernel-overdue-reports")

    async def close(self) -> None:
        self._stop_loop = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def opened(self, entry: Any, *, moment_id: str | None = None, logged: bool = False) -> None:
        """Register a permitted IDP (``IdpEntry``) as waiting for its report; ``logged``:
        its ``CEDAR_PERMIT_RECORDED`` registers it (the log pass), no key is written."""
        if self.kv is None or self.deadline_s <= 0 or logged:
            return
        op = OpenPermit(
            so_id=entry.so_id, idp_id=entry.idp_id, agent=entry.agent, principal=entry.principal,
            session_id=entry.session_id, requested_action=entry.requested_action,
            submitted_seq=entry.submitted_seq, deadline_at=time.time() + self.deadline_s, moment_id=moment_id,
        )
        # kv.put through publish_acked: the same stored entry at less client CPU (on
        # the PERMIT's reply path, beside the index entry and CEDAR_PERMIT_RECORDED).
        js = self.kernel.js
        await publish_acked(js._nc, f"$KV.{BUCKET}.{_key(entry.so_id, entry.idp_id)}", msgspec.json.encode(op), {},
                            js._timeout)

    async def closed(self, so_id: str, idp_id: str, *, keyed: bool = True) -> None:
        """The report came: nothing is overdue. ``keyed``: the permit may have a key to delete
        (a permit registered by its log event alone has none; its index entry, now
        ``transitioned``, keeps the log pass from closing it)."""
        if self.kv is None or not keyed:
            return
        with contextlib.suppress(KeyNotFoundError):
            await self.kv.delete(_key(so_id, idp_id))

    async def _loop(self) -> None:
        every = min(max(self.deadline_s / 4, 0.2), 30.0)
        # Not `while True`: close() sets _stop_loop before it cancels, so a cancel swallowed by
        # Python 3.11's wait_for race (turned into TimeoutError, caught below) cannot keep it going.
        while not self._stop_loop:
            await asyncio.sleep(every)
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("sweeping overdue transition reports failed")

    async def sweep(self, now: float | None = None) -> int:
        """Close every permit past its deadline; how many were closed."""
        now = time.time() if now is None else now
        closed = await self._sweep_log(now) if self.log_ready else 0
        keys, markers = await listing(self.kernel.js, self.kv, BUCKET)
        for key in keys:
            try:
                e = await self.kv.get(key)
            except KeyNotFoundError:
                continue
            if not e.value:
                continue
            try:
                op = msgspec.json.decode(e.value, type=OpenPermit)
            except (msgspec.DecodeError, msgspec.ValidationError):
                # Not the kernel's record (a party's PubAck aimed at this key, docs/security.md "Replies"):
                # dropped, and the sweep goes on with every other permit (before, it stopped every sweep).
                log.warning("an open permit's key holds no record of the kernel's; deleted", key=key[:200])
                with contextlib.suppress(KeyNotFoundError):
                    await self.kv.delete(key)
                continue
            if op.deadline_at > now:
                continue
            got = await self.kernel.state.idp(op.so_id, op.idp_id)
            if got is None or (got[0].status in ("permitted", "hem_approved") and got[0].overdue_seq is None):
                await self._time_out(op)
                closed += 1
            with contextlib.suppress(KeyNotFoundError):
                await self.kv.delete(key)
        await sweep_markers(self.kernel.js, BUCKET, markers, now)  # the closed permits' markers, read by every sweep
        return closed

    async def _sweep_log(self, now: float) -> int:
        """The log pass: ``CEDAR_PERMIT_RECORDED`` events after the position, up to the first
        one still inside its deadline; how many permits it closed."""
        k = self.kernel
        stored, foreign = await k.state.position_read(POSITION_KEY)
        pos = self.swept_to = max(stored, self.swept_to)
        if foreign:  # the kernel's own value back (read as 0 at a start, when this process knows none)
            await k.state.kv.put(POSITION_KEY, str(pos).encode())
        subject = k.subjects.log(PERMIT_EVENT)
        try:
            last = (await k.js.get_last_msg(LOG_STREAM, subject)).seq or 0
        except NotFoundError:
            return 0
        if last <= pos:
            return 0
        sub = await k.js.subscribe(
            subject, stream=LOG_STREAM, ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=pos + 1),
        )
        closed, swept = 0, pos
        try:
            while swept < last:
                msg = await sub.next_msg(timeout=10)
                seq = msg.metadata.sequence.stream
                self.read_events += 1
                try:
                    ev = log_event_decoder.decode(msg.data)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    # Not the kernel's (eventlog.walk_log reports such a record at start and to
                    # `pgw log verify`); the sweep goes on past it.
                    log.warning("overdue sweep: a log record that does not decode is skipped", seq=seq)
                    swept = seq
                    continue
                if parse_rfc3339(ev.ts).timestamp() + self.deadline_s > now:
                    break  # this one and every later one is not due yet
                closed += await self._log_permit(ev.body)
                swept = seq
        finally:
            await sub.unsubscribe()
        if swept > pos:
            # A plain put: two gateways sweeping at once may set it back a little; a
            # permit read twice is skipped by its overdue_seq.
            await k.state.kv.put(POSITION_KEY, str(swept).encode())
            self.swept_to = swept
        return closed

    async def _log_permit(self, body: dict[str, Any]) -> int:
        got = await self.kernel.state.idp(body["so_id"], body["idp_id"])
        if got is not None:
            e = got[0]
            if e.status != "permitted" or e.overdue_seq is not None:
                return 0  # reported, or closed already (a HEM approval has its own key)
            principal = e.principal
        else:
            # The index lags the log (a crash between the two): the log says who.
            principal = (await self.kernel.eventlog.get(body["idp_submitted_seq"])).body.get("principal") or ""
        await self._time_out(OpenPermit(
            so_id=body["so_id"], idp_id=body["idp_id"], agent=body["agent"], principal=principal,
            session_id=body["session_id"], requested_action=body["requested_action"],
            submitted_seq=body["idp_submitted_seq"], deadline_at=0.0,
        ))
        return 1

    async def _time_out(self, op: OpenPermit) -> None:
        body = {"idp_id": op.idp_id, "so_id": op.so_id, "session_id": op.session_id, "agent": op.agent,
                "principal": op.principal, "requested_action": op.requested_action,
                "idp_submitted_seq": op.submitted_seq, "report_deadline_s": self.deadline_s,
                "moment_id": op.moment_id}
        so, idp = op.so_id.lower(), op.idp_id.lower()
        ev = await self.kernel.eventlog.append(EVENT, body, msg_id=stable_id(EVENT, so, idp))
        why = (f"no transition report within {self.deadline_s:g} s of the permit; "
               "whether the action ran is unknown to the gateway")
        await self.kernel.publisher.verdict(
            Verdict(
                verdict_id=stable_id("idp-report-overdue", so, idp), verdict_class="timeout", decision="accept",
                # A HEM-approved step: the human's approval is the decision this verdict closes.
                approver="human" if op.moment_id else "policy", human_disposed=bool(op.moment_id),
                ts=now_rfc3339(), agent=op.agent, principal=op.principal,
                action_type=op.requested_action, action_id=op.idp_id, idp_id=op.idp_id, moment_id=op.moment_id,
                supersedes=stable_id("dispatch", op.moment_id) if op.moment_id else None,
                reason=Refusal(code="TRANSITION_REPORT_MISSING", reason=why),
                # Spec 004 §5.4.2: a timeout after dispatch is "timeout" with dispatched_unconfirmed.
                # The permit went out; whether the effect happened is unknown, so "not_applicable"
                # (nothing ran) would be a claim the gateway cannot make.
                effect=ReportedEffect(type=op.requested_action, status="dispatched"),
                details={"event_seq": ev.seq, "idp_submitted_seq": op.submitted_seq},
            )
        )
        # After the verdict: a crash before this leaves the permit to the next sweep,
        # whose event and verdict have the same ids (deduplicated).
        await self.kernel.state.mark_overdue(op.so_id, op.idp_id, ev.seq)
        log.warning("transition report overdue", agent=op.agent, idp_id=op.idp_id, event_seq=ev.seq)

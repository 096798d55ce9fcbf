"""Every permit is closed by a verdict: a PERMIT whose transition report never comes times out.

A kernel PERMIT (Cedar, or a human's approval through HEM) yields its
verdict only when the agent reports the transition (spec 003 §5.5). An agent
that crashes, or never reports, would leave the permit without a capsule,
and spec 004 §5.4.3 wants a capsule for every verdict, timeouts included.

So each permit is registered as open (KV bucket ``PGW_KERNEL_OPEN``, one key
per IDP, written before the PERMIT answer leaves the kernel) and the report
closes it. A sweep on every gateway (``kernel.report_deadline_s``, checked at
a quarter of that, at most every 30 s) takes the permits still open past
their deadline, and for each:

* logs ``TRANSITION_REPORT_OVERDUE`` (signed, chained; deterministic
  ``Nats-Msg-Id``, so two gateways sweeping at once log it once);
* publishes a ``timeout`` verdict (spec 004 §5.4.1 ``timeout``, "a timeout
  before dispatch" as far as the gateway saw: no effect is claimed, so the
  capsule's effect_mode is ``not_applicable``) with the reason
  ``TRANSITION_REPORT_MISSING``; its id is deterministic too;
* deletes the key.

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
from nats.js.errors import KeyNotFoundError, NoKeysError

from pgwcore.atomic import publish_acked
from pgwcore.logs import get_logger
from pgwcore.streams import ensure_kv
from subjects.util import now_rfc3339, stable_id
from subjects.wire import Refusal, Verdict

log = get_logger("pgw.kernel.overdue")

BUCKET = "PGW_KERNEL_OPEN"
EVENT = "TRANSITION_REPORT_OVERDUE"


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

    async def start(self) -> None:
        self.kv = await ensure_kv(self.kernel.js, BUCKET)
        if self.deadline_s > 0:
            self._task = asyncio.create_task(self._loop(), name="kernel-overdue-reports")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def opened(self, entry: Any, *, moment_id: str | None = None) -> None:
        """Register a permitted IDP (``IdpEntry``) as waiting for its report."""
        if self.kv is None or self.deadline_s <= 0:
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

    async def closed(self, so_id: str, idp_id: str) -> None:
        """The report came: nothing is overdue."""
        if self.kv is None:
            return
        with contextlib.suppress(KeyNotFoundError):
            await self.kv.delete(_key(so_id, idp_id))

    async def _loop(self) -> None:
        every = min(max(self.deadline_s / 4, 0.2), 30.0)
        while True:
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
        try:
            keys = await self.kv.keys()
        except NoKeysError:
            return 0
        closed = 0
        for key in keys:
            try:
                e = await self.kv.get(key)
            except KeyNotFoundError:
                continue
            if not e.value:
                continue
            op = msgspec.json.decode(e.value, type=OpenPermit)
            if op.deadline_at > now:
                continue
            got = await self.kernel.state.idp(op.so_id, op.idp_id)
            if got is None or got[0].status in ("permitted", "hem_approved"):
                await self._time_out(op)
                closed += 1
            with contextlib.suppress(KeyNotFoundError):
                await self.kv.delete(key)
        return closed

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
                approver="policy", human_disposed=False, ts=now_rfc3339(), agent=op.agent, principal=op.principal,
                action_type=op.requested_action, action_id=op.idp_id, idp_id=op.idp_id, moment_id=op.moment_id,
                reason=Refusal(code="TRANSITION_REPORT_MISSING", reason=why),
                details={"event_seq": ev.seq, "idp_submitted_seq": op.submitted_seq},
            )
        )
        log.warning("transition report overdue", agent=op.agent, idp_id=op.idp_id, event_seq=ev.seq)

"""Transition reports (spec 003 §5.5): the kernel's side of ``{prefix}.agent.*.transition``.

Split from ``gateway.kernel.service`` (issue 18): the durable pull consumer
``pgw-kernel`` on ``PGW_INBOUND`` and what each report becomes
(``STATE_TRANSITIONED``, then ``IDP_COMMITMENT_VERIFIED`` or
``IDP_COMMITMENT_GAP``, and a verdict; a second, different report of one
IDP is a critical finding, never a second ``STATE_TRANSITIONED``). The methods run on
:class:`gateway.kernel.service.KernelService`, whose state they share.

Once the kernel has recorded a report (its events and verdict, whatever it
made of it), a report that held a secret leaves ``PGW_INBOUND`` with erase and
its redacted form is kept in ``PGW_INBOUND_REDACTED``, then it is acked
(gateway/at_rest.py; spec 002 SR-1, docs/security.md "Data at rest"). What the
kernel keeps of it: ``executed_action`` and the effect's type, status,
``external_ref`` and ``irreversibility_class`` in its signed events as
reported (spec 003 §5.5) with their secrets redacted (the match is judged on
the report as sent), the effect's request and response only as digests;
the verdict's copy of the effect is SR-1 redacted (``Publisher.verdict``). A
crash between the record and the ack redelivers the report, which records
nothing twice and is settled again. A report the kernel fails to record on
each of ``gateway.max_deliver`` deliveries is dead-lettered
(``gateway.deadletter``), so it too leaves ``PGW_INBOUND``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Literal

import msgspec
import structlog
from nats.errors import TimeoutError as NatsTimeout
from prometheus_client import Counter

from gateway.at_rest import settle_raw
from gateway.kernel.eventlog import Appended, EventLog
from gateway.kernel.hem import WHY, held_report_moment, held_report_notice
from gateway.kernel.overdue import OverdueReports
from gateway.kernel.repairs import OVERFLOW_DELAY_S, StepNeedsRepair, StepRepairs, overflow_reason
from gateway.kernel.state import ForeignRecord, IdpEntry, KernelState
from gateway.stages.base import Turn
from pgwcore.atomic import stored_by_reply
from pgwcore.logs import get_logger
from pgwcore.metrics import REGISTRY
from subjects import jcs
from subjects.errors import SubjectError
from subjects.idp import (
    TransitionReport,
    canonical_id,
    decode_idp,
)
from subjects.util import now_rfc3339, stable_id
from subjects.wire import BindingMoment, NoticeItem, Refusal, ReportedEffect, Verdict

log = get_logger("pgw.kernel")

# spec 003 §8.7: "agents MUST NOT be able to influence match_result; the comparison
# happens entirely within the kernel". The kernel compares the declaration with the
# executed action the agent itself reports: no action transits a kernel gate yet, so
# every record says so (docs/kernel.md, "Commitment verification and §8.7").
EXECUTED_ACTION_SOURCE = "agent_reported"
# What Cedar sees of it (context.execution): a policy may require the gate.
EXECUTION_CONTEXT = {"gated": False, "executed_action_source": EXECUTED_ACTION_SOURCE}

SECOND_REPORTS = Counter(
    "pgw_idp_second_reports_total",
    "Second, different transition reports for one IDP: CRITICAL findings (spec 003 §5.3, §5.5.2)",
    ["agent"],
    registry=REGISTRY,
)
COMMITMENT_GAPS = Counter(
    "pgw_idp_commitment_gaps_total",
    "IDP_COMMITMENT_GAP findings: CRITICAL audit alerts (spec 003 §5.5.2)",
    ["agent"],
    registry=REGISTRY,
)

HELD_REPORTS = Counter(
    "pgw_idp_reports_while_held_total",
    "Transition reports of an earlier permit while the session or its governed object is held (HEM pending, "
    "terminated): CRITICAL findings (spec 003 §4.4, §5.5.2)",
    ["agent", "held_by"],
    registry=REGISTRY,
)


# Spec 004 §5.4.2: "failed" (ran, returned a clean failure, state known) is an effect status of an
# executed action, never the reason-class errored (ran and threw, state unknown).
_ERRORED = {"error", "errored", "failure"}


def _as_sent(text: str) -> str:
    """How a redacted leaf of a report is kept: as sent, its secrets aside (no character dropped or marked)."""
    return text


def _closes(entry: IdpEntry) -> str | None:
    """The verdict a transition's verdict supersedes (spec 004 §5.4.4), if any.

    A report after the overdue timeout supersedes that timeout, which said the
    outcome was unknown; otherwise a HEM-approved step's execution closes the
    dispatch of its moment (§5.4.2: "executed" chained to the dispatch is the
    one encoding of a closure with effect).
    """
    if entry.overdue_seq is not None:
        return stable_id("idp-report-overdue", entry.so_id.lower(), entry.idp_id.lower())
    if entry.moment_id:
        return stable_id("dispatch", entry.moment_id)
    return None


def recorded_status(reported: str, response_digest: str | None) -> tuple[str, str | None]:
    """(the effect status the log and the capsule record, the reported one where it differs).

    Spec 004 §5.2: "confirmed" is an observed result bound by the digest of the
    response, never without it; a report that says confirmed and carries no
    response is recorded as ``dispatched``, the status it does support, with
    the reported status beside it. Recorded, not refused: the agent says the
    transition happened, and spec 003 §5.3/§5.5 require STATE_TRANSITIONED and
    its commitment check for it (a refusal would hide an executed action).
    STATE_TRANSITIONED and the capsule then state the same effect status.
    """
    if reported == "confirmed" and response_digest is None:
        return "dispatched", reported
    return reported, None


def _second_report_moment(
    moment: BindingMoment, agent: str, session_id: str, declared: str, first: Any, second: str
) -> BindingMoment:
    """The HEM moment of a second report: what happened, first among the findings of the moment
    ``hem_moment`` built (its synopsis and question, which name no session id, stand)."""
    because = (f"{WHY}agent {agent} declared {declared[:100]} once, reported doing {str(first)[:100]}, then reported "
               f"doing {second[:100]} for the same step (no declaration covers it), so the gateway stopped the session "
               "until you decide.")
    findings = [because, *(f for f in moment.findings if not f.startswith(WHY))]
    return msgspec.structs.replace(moment, findings=findings)


class TransitionReports:
    """The transition-report methods of :class:`gateway.kernel.service.KernelService` (state lives on the service)."""

    nc: Any
    gw: Any
    js: Any
    config: Any
    cfg: Any
    subjects: Any
    state: KernelState
    eventlog: EventLog
    overdue: OverdueReports
    repairs: StepRepairs
    publisher: Any
    key: Any
    _psub: Any
    _stopping: bool
    _busy: bool
    gated: Any
    _session: Any  # KernelService._session: the session, its decided escalations settled
    _hold: Any  # KernelService._hold: the hold of the agent's governed object

    # -- transition reports (spec 003 §5.5) -------------------------------------------
    async def _transition_loop(self) -> None:
        while not self._stopping:
            if self.nc.is_closed:
                # The owner closed the connection without draining us (e.g. a failed start).
                return
            try:
                msgs = await self._psub.fetch(batch=self.config.gateway.batch, timeout=1)
            except (NatsTimeout, TimeoutError):
                continue
            except asyncio.CancelledError:
                return
            except Exception:
                if self._stopping or self.nc.is_closed:
                    return
                log.exception("fetching transition reports failed")
                await asyncio.sleep(0.5)
                continue
            self._busy = True
            try:
                await self._process_batch(msgs)
            finally:
                self._busy = False

    async def _process_batch(self, msgs: list[Any]) -> None:
        for msg in msgs:
            await self._one_report(msg)

    async def _one_report(self, msg: Any, *, held: bool = False) -> None:
        """Judge one report and settle its message; ``held``: it comes back from ``self.repairs`` (repairs.py),
        its step's records written again, and is judged as it stands."""
        structlog.contextvars.clear_contextvars()
        try:
            if stored_by_reply(msg):  # no report of the agent's (pgwcore.atomic.stored_by_reply)
                log.warning("passed over the server's publish acknowledgement stored on an agent's subject",
                            subject=msg.subject[:200])
                await msg.term()
                return
            agent = self.subjects.parse(msg.subject).token or ""
            headers = msg.headers or {}
            tp = await self.gw.traceparent(headers)
            structlog.contextvars.bind_contextvars(agent=agent, traceparent=tp)
            seq = msg.metadata.sequence.stream
            try:
                await self.handle_transition(agent, msg.data, seq, traceparent=tp, foreign="fail" if held else "hold")
            except StepNeedsRepair as e:
                # Held until the walk that repairs the step, or in order behind a report of it held there;
                # the loop goes on with the next report (repairs.py). Past the agent's share of what may be
                # held, dead-lettered at once; when only the places of all are taken (or dead letters are
                # off), handed back and redelivered later.
                room = self.repairs.room(agent)
                if room == "yes":
                    self.repairs.hold(msg, e.step, walk=e.walk)
                    return
                if room == "share" and await self._dead_letter(msg, reason=overflow_reason()):
                    log.warning("too many of the agent's reports wait for a walk of the log; this one is "
                                "dead-lettered", idp_id=e.step[1])
                    return
                log.warning("too many reports wait for a walk of the log; this one is handed back",
                            idp_id=e.step[1], limit=room)
                with contextlib.suppress(Exception):
                    await msg.nak(delay=OVERFLOW_DELAY_S)
                return
            # Recorded: a report that held a secret leaves PGW_INBOUND (module docstring).
            report = Turn(agent=agent, subject=msg.subject, stream_seq=seq, body=msg.data,
                          msg_id=headers.get("Nats-Msg-Id"), traceparent=tp,
                          principal=headers.get("Pgw-Principal"), headers=headers)
            await settle_raw(self.js, (await self.gw.stage_state.get()).redactor, report)
            with contextlib.suppress(Exception):  # erased already: nothing left to redeliver
                await msg.ack()
        except SubjectError:
            await msg.term()
        except Exception:
            if await self._dead_letter(msg):
                return
            log.exception("transition report failed; will be redelivered", subject=msg.subject)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1)

    async def _dead_letter(self, msg: Any, *, reason: str | None = None) -> bool:
        """On a report's last allowed delivery: its dead letter (gateway/deadletter.py), so it does not stay
        in PGW_INBOUND as sent for the stream's 7 days; True when it was recorded and terminated. With
        ``reason``: now, whatever its deliveries (a report past its agent's share of what may be held,
        repairs.py)."""
        dead = getattr(self.gw, "dead_letters", None)
        if dead is None:  # ops.dead_letter off: the report stays, as a turn does
            return False
        try:
            md = msg.metadata
            headers = msg.headers or {}
            report = Turn(agent=self.subjects.parse(msg.subject).token or "", subject=msg.subject,
                          stream_seq=md.sequence.stream, body=msg.data, msg_id=headers.get("Nats-Msg-Id"),
                          traceparent=await self.gw.traceparent(headers), num_delivered=md.num_delivered,
                          principal=headers.get("Pgw-Principal"), headers=headers)
            if reason is not None:
                await dead.give_up_report(report, msg, reason)
                return True
            return bool(await dead.on_report_failure(report, msg))
        except Exception:  # the advisory records it once max_deliver is reached
            log.exception("dead-lettering a transition report failed", subject=msg.subject)
            return False

    async def handle_transition(self, agent: str, data: bytes, msg_seq: int, *, traceparent: str | None = None,
                                foreign: Literal["repair", "hold", "fail"] = "repair") -> str:
        """Process one report; return what happened (``verified``, ``gap`` or ``refused:...``).

        ``foreign``: what a foreign record of the report's step does (repairs.py). ``repair``: the step is
        repaired in the next walk and the report judged after it; ``hold`` (the reports' loop):
        ``StepNeedsRepair`` is raised, and also while a report of the step is held; ``fail`` (a held report
        judged after its walk): ``ForeignRecord`` is raised."""
        tp = traceparent
        try:
            rep = msgspec.json.decode(data, type=TransitionReport)
        except Exception as e:  # noqa: BLE001 - any malformed report is refused and logged
            return await self._refuse_transition(agent, None, f"malformed report: {str(e)[:200]}", msg_seq, tp)
        if jcs.maybe_unrecordable(data) and not jcs.recordable(msgspec.to_builtins(rep)):
            # Its digest (spec 004 JSON-DIGEST, RFC 8785) cannot be taken: an integer beyond +-(2**53 - 1). Refused
            # like any malformed report, once; before, it failed until dead-lettered (found by an attack from the
            # docs). Its step stays unreported, as if no report came: the overdue sweep closes it.
            return await self._refuse_transition(
                agent, None, "malformed report: it cannot be recorded (RFC 8785 JSON holds integers within "
                "+-(2**53 - 1) only; send a larger number as a string)", msg_seq, tp)
        raw = msgspec.structs.replace(rep, idp_id=canonical_id(rep.idp_id))
        # spec 002 SR-1: the kernel's signed events are never deleted, so what it keeps and says of a
        # report (its events, refusals, findings, log lines, what the principal is told) is the report
        # with its secrets redacted, ``rep`` from here on; the report as sent (``raw``) is only compared
        # (the gate rule, §5.5.3's string-exact match) and digested (docs/security.md "Data at rest").
        rep = await self._kept(raw)
        step = (agent, rep.idp_id)
        if foreign == "hold" and self.repairs.holds(step):
            raise StepNeedsRepair(*step, walk=False)  # judged after the report of the step held before it
        try:
            so_id = await self.state.so_of(agent, rep.idp_id)
            got = await self.state.idp(so_id, rep.idp_id) if so_id else None
        except ForeignRecord:
            # The step's records were overwritten by a value the kernel never wrote: written again from
            # the signed log, then the report is judged as it would have been (state.repair_steps). A step
            # the log never declared is judged as undeclared, as before the value was written. The walk
            # is shared and spaced (repairs.py); the reports' loop holds the report there and goes on.
            if foreign == "fail":
                raise
            if foreign == "hold":
                raise StepNeedsRepair(*step) from None
            got = None
            if await self.repairs.repair(step):
                so_id = await self.state.so_of(agent, rep.idp_id)
                got = await self.state.idp(so_id, rep.idp_id) if so_id else None
        if got is None:
            # spec 003 §5.3: no STATE_TRANSITIONED without a preceding IDP_SUBMITTED. A gated action
            # claimed with no declaration at all is the §8.7 finding below as well.
            if self.gated(raw.executed_action):
                return await self._refuse_transition(
                    agent, rep, f"no IDP_SUBMITTED for this step, and {rep.executed_action} must transit a kernel gate",
                    msg_seq, tp, code="GATE_REQUIRED",
                    alert={"severity": "CRITICAL", "alert_trigger": "GATE_REQUIRED", "actions": [rep.executed_action]},
                )
            return await self._refuse_transition(agent, rep, "no IDP_SUBMITTED for this step", msg_seq, tp)
        entry = got[0]
        if entry.status == "hem_pending":
            await self._session(agent, entry.session_id)
            entry = (await self.state.idp(entry.so_id, entry.idp_id) or got)[0]
        if entry.status == "dispatched" or (entry.status == "transitioned" and await self._gate_transitioned(entry)):
            # spec 003 §8.7: the kernel dispatched this step itself (gate.py); the agent's word
            # on it is not taken, and a report of it is a finding like any gated action's.
            return await self._refuse_transition(
                agent, rep, "this step transited the kernel's gate; its transition is recorded by the kernel",
                msg_seq, tp, code="GATE_REQUIRED",
                alert={"severity": "CRITICAL", "alert_trigger": "GATE_REQUIRED", "actions": [entry.requested_action]},
            )
        gated = [a for a in dict.fromkeys((entry.requested_action, raw.executed_action)) if self.gated(a)]
        gated = [rep.executed_action if a == raw.executed_action else a for a in gated]  # named as kept
        if gated:
            # spec 003 §8.7: a gated action reported on the agent-report path did not
            # transit a gate, so its comparison would rest on the agent's word: refused,
            # and a finding (no STATE_TRANSITIONED: the kernel does not take it as governed).
            return await self._refuse_transition(
                agent, rep, f"{', '.join(gated)} must transit a kernel gate; an agent's report is not accepted for it",
                msg_seq, tp, code="GATE_REQUIRED",
                alert={"severity": "CRITICAL", "alert_trigger": "GATE_REQUIRED", "actions": gated},
            )
        if entry.status not in ("permitted", "hem_approved", "transitioned"):
            return await self._refuse_transition(agent, rep, f"the IDP was not permitted (status {entry.status})", msg_seq, tp)
        report_digest = jcs.json_digest(msgspec.to_builtins(raw))
        eff = rep.effect
        resp_digest = jcs.json_digest(raw.effect.response) if raw.effect.response is not None else None
        status, reported = recorded_status(eff.status, resp_digest)
        st_body = {
            "idp_id": entry.idp_id, "so_id": entry.so_id, "session_id": entry.session_id, "agent": agent,
            "principal": entry.principal, "step_sequence": entry.step_sequence,
            "executed_action": rep.executed_action, "executed_action_source": EXECUTED_ACTION_SOURCE,
            "idp_submitted_seq": entry.submitted_seq,
            "effect": {"type": eff.type, "status": status, "external_ref": eff.external_ref,
                       "irreversibility_class": eff.irreversibility_class,
                       "request_digest": jcs.json_digest(raw.effect.request) if raw.effect.request is not None else None,
                       "response_digest": resp_digest},
            "effect_attestation": "runtime_claimed",
            "report_digest": report_digest,
        }
        if reported is not None:
            st_body["effect"]["status_reported"] = reported
        # spec 003 §5.3, §5.5: every STATE_TRANSITIONED is followed by its verification, so
        # whether this IDP was reported already is decided before anything is appended,
        # not by the log's duplicate window (past it, an append would succeed).
        first = await self._reported(entry)
        if first is not None:
            if first.event.body.get("report_digest") != report_digest:
                return await self._reported_twice(agent, rep, entry, first, report_digest, msg_seq, tp)
            st = first  # the same report again (a redelivery): finish it, append nothing twice
        else:
            held = await self._held(agent, entry)
            if held is not None:
                # spec 003 §4.4, §5.5.2: nothing continues while a REQUIRED escalation is pending or
                # after a human ended the work, a permit taken before the hold included.
                code, why = held
                HELD_REPORTS.labels(agent=agent, held_by=code).inc()
                refused = await self._refuse_transition(
                    agent, rep, why, msg_seq, tp, code=code,
                    alert={"severity": "CRITICAL", "alert_trigger": "TRANSITION_WHILE_HELD", "held_by": code},
                    extra={"so_id": entry.so_id, "session_id": entry.session_id},
                )
                await self._tell_held(agent, rep, entry, code, tp)
                return refused
            st_id = stable_id("STATE_TRANSITIONED", entry.so_id.lower(), entry.idp_id.lower())
            st = await self.eventlog.append("STATE_TRANSITIONED", st_body, msg_id=st_id, traceparent=tp)
            if st.duplicate and st.event.body.get("report_digest") != report_digest:
                # Another report of this IDP was logged first (a concurrent one).
                return await self._reported_twice(agent, rep, entry, st, report_digest, msg_seq, tp)
        matched = raw.executed_action == entry.requested_action  # spec 003 §5.5.3: string-exact, as sent
        record: dict[str, Any] = {
            "idp_id": entry.idp_id,
            "state_transition_id": st.event.event_id,
            "state_transition_seq": st.seq,
            "verified_at": now_rfc3339(),
            "match_result": "MATCHED" if matched else "IDP_COMMITMENT_GAP",
            "requested_action": entry.requested_action,
            "executed_action": rep.executed_action,
            "executed_action_source": EXECUTED_ACTION_SOURCE,
            "kid": self.key.kid,
        }
        # spec 003 §5.5.1: Ed25519 over the canonical serialization of all other fields.
        record["kernel_signature"] = self.eventlog.sign_record(record)
        etype = "IDP_COMMITMENT_VERIFIED" if matched else "IDP_COMMITMENT_GAP"
        vbody: dict[str, Any] = {"record": record, "so_id": entry.so_id, "session_id": entry.session_id, "agent": agent,
                                 "executed_action_source": EXECUTED_ACTION_SOURCE}
        if not matched:
            vbody["alert"] = {"severity": "CRITICAL", "alert_trigger": "IDP_COMMITMENT_GAP"}
        if entry.verification_seq is not None:
            vev = Appended(entry.verification_seq, await self.eventlog.get(entry.verification_seq), True)
        else:
            vev = await self.eventlog.append(etype, vbody, msg_id=stable_id(etype, entry.so_id.lower(), entry.idp_id.lower()), traceparent=tp)
        record = vev.event.body["record"]
        await self.state.advance_idp(entry.so_id, entry.idp_id, "transitioned", transition_seq=st.seq,
                                     verification_seq=vev.seq)
        # A Cedar permit with CEDAR_PERMIT_RECORDED has no PGW_KERNEL_OPEN key (overdue.py).
        await self.overdue.closed(entry.so_id, entry.idp_id,
                                  keyed=entry.status == "hem_approved" or not self.cfg.log_permits)
        if not matched:
            COMMITMENT_GAPS.labels(agent=agent).inc()
            log.critical("IDP_COMMITMENT_GAP", agent=agent, idp_id=entry.idp_id, requested=entry.requested_action,
                         executed=rep.executed_action[:200], alert_trigger="IDP_COMMITMENT_GAP")
            sub_ev = await self.eventlog.get(entry.submitted_seq)
            idp = decode_idp(sub_ev.body["idp"])
            await self._escalate(agent=agent, principal=entry.principal, idp=idp, trigger="IDP_COMMITMENT_GAP",
                                 mandate_id=entry.mandate_id, verification=record, tp=tp)
        await self._transition_verdict(agent, entry, rep, resp_digest, record, tp)
        return "verified" if matched else "gap"

    async def _kept(self, raw: TransitionReport) -> TransitionReport:
        """``raw`` with every secret redacted (SR-1), everything else as sent; ``raw`` itself when clean."""
        red = (await self.gw.stage_state.get()).redactor
        if red.plainly_clean(raw):
            return raw
        builtins = msgspec.to_builtins(raw)
        kept = red.graph(builtins, show=_as_sent)
        if kept is builtins:
            return raw
        try:
            return msgspec.convert(kept, TransitionReport)
        except msgspec.ValidationError:  # a typed number that reads as a secret of digits stays a number
            return msgspec.convert(red.graph(builtins, show=_as_sent, numbers=False), TransitionReport)

    async def _held(self, agent: str, entry: IdpEntry) -> tuple[str, str] | None:
        """(code, reason) when the step's session or governed object is held, else None.

        Judged on the session and the hold of the agent's governed object (spec 003 §4.4:
        HEM_PENDING holds every IDP of the agent for the object; §5.5.2: a gap or a second
        report is not continued past until a human resolves it, and a Deny ends the mandate),
        not on the IDP entry alone: a permit taken before the hold does not outlive it.
        """
        sess, _ = await self._session(agent, entry.session_id)
        hold = await self._hold(agent, entry.so_id, await self.state.hold(agent, entry.so_id))
        if sess.state == "TERMINATED" or (entry.mandate_id is not None and entry.mandate_id in hold.terminated):
            return "SESSION_TERMINATED", "the session was terminated by the principal; no earlier permit may be reported"
        if sess.state == "HEM_PENDING" or hold.pending:
            return "HEM_PENDING", "an escalation to the principal is pending; no earlier permit may be reported until it is resolved"
        return None

    async def _tell_held(self, agent: str, rep: TransitionReport, entry: IdpEntry, code: str, tp: str | None) -> None:
        """The principal learns of a report refused while held (spec 003 §4.4, §5.5.2).

        While an escalation is pending she is still deciding, so the report is an escalation of its
        own, queued behind the pending one: a moment that says what was reported (``hem.held_report_moment``);
        the session continues only once she has approved both. After she ended the session there is
        nothing left to decide: a notice says what was reported. One per declared step (its id names
        the IDP, not the report), so an agent re-wording its report does not flood her.
        """
        so, idp_id = entry.so_id.lower(), entry.idp_id.lower()
        if code == "HEM_PENDING" and entry.mandate_id is not None:
            idp = decode_idp((await self.eventlog.get(entry.submitted_seq)).body["idp"])
            await self._escalate(
                agent=agent, principal=entry.principal, idp=idp, trigger="TRANSITION_WHILE_HELD",
                mandate_id=entry.mandate_id, tp=tp,
                retell=lambda moment: held_report_moment(moment, agent, rep.executed_action),
                moment_id=stable_id("hem", "TRANSITION_WHILE_HELD", so, idp_id),
                extra={"executed_action": rep.executed_action, "held_by": code},
            )
            return
        item_id = stable_id("held-report-notice", so, idp_id)[:32]
        await self.publisher.surface(
            NoticeItem(agent=agent, principal=entry.principal, created_at=now_rfc3339(), traceparent=tp,
                       item_id=item_id, envelope_id=entry.idp_id,
                       diagnostic=held_report_notice(agent, rep.executed_action)),
            f"notice:{item_id}",
        )

    async def _gate_transitioned(self, entry: IdpEntry) -> bool:
        """The step's STATE_TRANSITIONED was written by the gate (kernel_dispatched)."""
        if entry.transition_seq is None:
            return False
        ev = await self.eventlog.get(entry.transition_seq)
        return ev.body.get("executed_action_source") == "kernel_dispatched"

    async def _reported(self, entry: IdpEntry) -> Appended | None:
        """The STATE_TRANSITIONED already logged for this IDP, or None."""
        if entry.status != "transitioned" or entry.transition_seq is None:
            return None
        return Appended(entry.transition_seq, await self.eventlog.get(entry.transition_seq), True)

    async def _reported_twice(
        self, agent: str, rep: TransitionReport, entry: IdpEntry, first: Appended, report_digest: str,
        msg_seq: int, tp: str | None,
    ) -> str:
        """A second, different transition reported for one declared step: no STATE_TRANSITIONED
        is written for it (spec 003 §5.3: one declaration, one transition), and it is a
        critical finding like a commitment gap (§5.5.2): logged as such (``TRANSITION_REFUSED``
        with a CRITICAL alert), a ``critical`` log line and metric, and HEM for the session."""
        why = "a transition was already reported for this IDP"
        first_action = first.event.body.get("executed_action")
        alert = {"severity": "CRITICAL", "alert_trigger": "TRANSITION_REPORTED_TWICE"}
        await self._refuse_transition(agent, rep, why, msg_seq, tp, extra={
            "so_id": entry.so_id, "session_id": entry.session_id, "requested_action": entry.requested_action,
            "first_transition_seq": first.seq, "first_executed_action": first_action,
            "report_digest": report_digest, "alert": alert,
        })
        SECOND_REPORTS.labels(agent=agent).inc()
        log.critical("TRANSITION_REPORTED_TWICE", agent=agent, idp_id=entry.idp_id, first_executed=first_action,
                     executed=rep.executed_action[:200], alert_trigger="TRANSITION_REPORTED_TWICE")
        idp = decode_idp((await self.eventlog.get(entry.submitted_seq)).body["idp"])

        def retell(moment: BindingMoment) -> BindingMoment:
            return _second_report_moment(moment, agent, idp.session_id, entry.requested_action, first_action,
                                         rep.executed_action)

        await self._escalate(
            agent=agent, principal=entry.principal, idp=idp, trigger="TRANSITION_REPORTED_TWICE",
            mandate_id=entry.mandate_id, tp=tp, retell=retell,
            moment_id=stable_id("hem", "TRANSITION_REPORTED_TWICE", entry.so_id.lower(), entry.idp_id.lower(), report_digest),
            extra={"executed_action": rep.executed_action, "first_transition_seq": first.seq},
        )
        return f"refused:{why}"

    async def _transition_verdict(
        self, agent: str, entry: IdpEntry, rep: TransitionReport, resp_digest: str | None,
        record: dict[str, Any], tp: str | None,
    ) -> None:
        eff = rep.effect
        status, reported = recorded_status(eff.status, resp_digest)
        details: dict[str, Any] = {"effect_attestation": "runtime_claimed", "match_result": record["match_result"],
                                   "executed_action": rep.executed_action, "requested_action": entry.requested_action,
                                   "executed_action_source": EXECUTED_ACTION_SOURCE}
        if resp_digest:
            details["response_digest"] = resp_digest
        if reported is not None:
            details["effect_status_reported"] = reported
        errored = eff.status.lower() in _ERRORED
        human = entry.status == "hem_approved" or entry.moment_id is not None
        v = Verdict(
            verdict_id=stable_id("idp-transition", entry.so_id.lower(), entry.idp_id.lower()),
            verdict_class="errored" if errored else "executed",
            decision="accept",
            approver="human" if human else "policy",
            # The principal approved this very step through HEM (DESIGN §6 "as happened").
            human_disposed=human,
            ts=now_rfc3339(), agent=agent, principal=entry.principal, action_type=entry.requested_action,
            action_id=entry.idp_id, idp_id=entry.idp_id, moment_id=entry.moment_id,
            supersedes=_closes(entry),
            traceparent=tp,
            effect=ReportedEffect(type=eff.type, status=status, request=eff.request, response=eff.response,
                                  external_ref=eff.external_ref, irreversibility_class=eff.irreversibility_class),
            details=details,
        )
        await self.publisher.verdict(v)

    async def _refuse_transition(
        self, agent: str, rep: TransitionReport | None, why: str, msg_seq: int, tp: str | None,
        *, code: str = "TRANSITION_REFUSED", alert: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        key = stable_id("TRANSITION_REFUSED", agent, str(msg_seq))
        body: dict[str, Any] = {"agent": agent, "reason": why, "inbound_seq": msg_seq,
                                "idp_id": rep.idp_id if rep else None, "executed_action": rep.executed_action if rep else None,
                                "executed_action_source": EXECUTED_ACTION_SOURCE, **(extra or {})}
        if code != "TRANSITION_REFUSED":
            body["code"] = code
        if alert is not None:
            body["alert"] = alert  # a finding: the audit record lists it under alerts
        await self.eventlog.append("TRANSITION_REFUSED", body, msg_id=key, traceparent=tp)
        (log.critical if alert else log.warning)("transition refused", agent=agent, reason=why, idp_id=body["idp_id"], code=code)
        # spec 004 §8.1: the verdict (and so the denied capsule) names the kind of check, never the
        # agent's executed action: that stays in the signed TRANSITION_REFUSED event for the auditor.
        await self.publisher.verdict(
            Verdict(
                verdict_id=stable_id("idp-transition-refused", key), verdict_class="denied", decision="reject",
                approver="policy", human_disposed=False, ts=now_rfc3339(), agent=agent,
                action_type="idp.transition", action_id=(rep.idp_id if rep else key),
                idp_id=rep.idp_id if rep else None, traceparent=tp,
                reason=Refusal(code=code, reason=why),
            )
        )
        return f"refused:{why}"

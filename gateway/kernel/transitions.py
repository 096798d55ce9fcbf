"""Transition reports (spec 003 §5.5): the kernel's side of ``{prefix}.agent.*.transition``.

Split from ``gateway.kernel.service`` (issue 18): the durable pull consumer
``pgw-kernel`` on ``PGW_INBOUND`` and what each report becomes
(``STATE_TRANSITIONED``, then ``IDP_COMMITMENT_VERIFIED`` or
``IDP_COMMITMENT_GAP``, and a verdict). The methods run on
:class:`gateway.kernel.service.KernelService`, whose state they share.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import rfc8785
import structlog
from nats.errors import TimeoutError as NatsTimeout
from prometheus_client import Counter

from gateway.kernel.eventlog import EventLog
from gateway.kernel.overdue import OverdueReports
from gateway.kernel.state import IdpEntry, KernelState
from pgwcore.logs import get_logger
from pgwcore.metrics import REGISTRY
from subjects.errors import SubjectError
from subjects.idp import (
    TransitionReport,
    b64url,
    decode_idp,
    json_digest,
)
from subjects.util import now_rfc3339, stable_id
from subjects.wire import Refusal, ReportedEffect, Verdict

log = get_logger("pgw.kernel")

COMMITMENT_GAPS = Counter(
    "pgw_idp_commitment_gaps_total",
    "IDP_COMMITMENT_GAP findings: CRITICAL audit alerts (spec 003 §5.5.2)",
    ["agent"],
    registry=REGISTRY,
)

# Spec 004 §5.4.2: "failed" (ran, returned a clean failure, state known) is an effect status of an
# executed action, never the reason-class errored (ran and threw, state unknown).
_ERRORED = {"error", "errored", "failure"}


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


class TransitionReports:
    """The transition-report methods of :class:`gateway.kernel.service.KernelService` (state lives on the service)."""

    nc: Any
    config: Any
    subjects: Any
    state: KernelState
    eventlog: EventLog
    overdue: OverdueReports
    publisher: Any
    key: Any
    _psub: Any
    _stopping: bool
    _busy: bool

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
            structlog.contextvars.clear_contextvars()
            try:
                agent = self.subjects.parse(msg.subject).token or ""
                tp = (msg.headers or {}).get("traceparent")
                structlog.contextvars.bind_contextvars(agent=agent, traceparent=tp)
                await self.handle_transition(agent, msg.data, msg.metadata.sequence.stream, traceparent=tp)
                await msg.ack()
            except SubjectError:
                await msg.term()
            except Exception:
                log.exception("transition report failed; will be redelivered", subject=msg.subject)
                with contextlib.suppress(Exception):
                    await msg.nak(delay=1)

    async def handle_transition(self, agent: str, data: bytes, msg_seq: int, *, traceparent: str | None = None) -> str:
        """Process one report; return what happened (``verified``, ``gap`` or ``refused:...``)."""
        tp = traceparent
        try:
            rep = msgspec.json.decode(data, type=TransitionReport)
        except Exception as e:  # noqa: BLE001 - any malformed report is refused and logged
            return await self._refuse_transition(agent, None, f"malformed report: {str(e)[:200]}", msg_seq, tp)
        so_id = await self.state.so_of(agent, rep.idp_id)
        got = await self.state.idp(so_id, rep.idp_id) if so_id else None
        if got is None:
            # spec 003 §5.3: no STATE_TRANSITIONED without a preceding IDP_SUBMITTED.
            return await self._refuse_transition(agent, rep, "no IDP_SUBMITTED for this step", msg_seq, tp)
        entry = got[0]
        if entry.status == "hem_pending":
            await self._session(agent, entry.session_id)
            entry = (await self.state.idp(entry.so_id, entry.idp_id) or got)[0]
        if entry.status not in ("permitted", "hem_approved", "transitioned"):
            return await self._refuse_transition(agent, rep, f"the IDP was not permitted (status {entry.status})", msg_seq, tp)
        report_digest = json_digest(msgspec.to_builtins(rep))
        eff = rep.effect
        resp_digest = json_digest(eff.response) if eff.response is not None else None
        status, reported = recorded_status(eff.status, resp_digest)
        st_body = {
            "idp_id": entry.idp_id, "so_id": entry.so_id, "session_id": entry.session_id, "agent": agent,
            "principal": entry.principal, "step_sequence": entry.step_sequence,
            "executed_action": rep.executed_action, "idp_submitted_seq": entry.submitted_seq,
            "effect": {"type": eff.type, "status": status, "external_ref": eff.external_ref,
                       "irreversibility_class": eff.irreversibility_class,
                       "request_digest": json_digest(eff.request) if eff.request is not None else None,
                       "response_digest": resp_digest},
            "effect_attestation": "runtime_claimed",
            "report_digest": report_digest,
        }
        if reported is not None:
            st_body["effect"]["status_reported"] = reported
        st_id = stable_id("STATE_TRANSITIONED", entry.so_id.lower(), entry.idp_id.lower())
        st = await self.eventlog.append("STATE_TRANSITIONED", st_body, msg_id=st_id, traceparent=tp)
        if st.duplicate and st.event.body.get("report_digest") != report_digest:
            return await self._refuse_transition(agent, rep, "a transition was already reported for this IDP", msg_seq, tp)
        if entry.status == "transitioned" and not st.duplicate and entry.transition_seq not in (None, st.seq):
            return await self._refuse_transition(agent, rep, "a transition was already reported for this IDP", msg_seq, tp)
        matched = rep.executed_action == entry.requested_action  # spec 003 §5.5.3: string-exact
        record: dict[str, Any] = {
            "idp_id": entry.idp_id,
            "state_transition_id": st.event.event_id,
            "state_transition_seq": st.seq,
            "verified_at": now_rfc3339(),
            "match_result": "MATCHED" if matched else "IDP_COMMITMENT_GAP",
            "requested_action": entry.requested_action,
            "executed_action": rep.executed_action,
            "kid": self.key.kid,
        }
        # spec 003 §5.5.1: Ed25519 over the canonical serialization of all other fields.
        record["kernel_signature"] = b64url(self.key.sign(rfc8785.dumps(record)))
        etype = "IDP_COMMITMENT_VERIFIED" if matched else "IDP_COMMITMENT_GAP"
        vbody: dict[str, Any] = {"record": record, "so_id": entry.so_id, "session_id": entry.session_id, "agent": agent}
        if not matched:
            vbody["alert"] = {"severity": "CRITICAL", "alert_trigger": "IDP_COMMITMENT_GAP"}
        vev = await self.eventlog.append(etype, vbody, msg_id=stable_id(etype, entry.so_id.lower(), entry.idp_id.lower()), traceparent=tp)
        record = vev.event.body["record"]
        await self.state.advance_idp(entry.so_id, entry.idp_id, "transitioned", transition_seq=st.seq)
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
                                 verification=record, tp=tp)
        await self._transition_verdict(agent, entry, rep, resp_digest, record, tp)
        return "verified" if matched else "gap"

    async def _transition_verdict(
        self, agent: str, entry: IdpEntry, rep: TransitionReport, resp_digest: str | None,
        record: dict[str, Any], tp: str | None,
    ) -> None:
        eff = rep.effect
        status, reported = recorded_status(eff.status, resp_digest)
        details: dict[str, Any] = {"effect_attestation": "runtime_claimed", "match_result": record["match_result"],
                                   "executed_action": rep.executed_action, "requested_action": entry.requested_action}
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
        self, agent: str, rep: TransitionReport | None, why: str, msg_seq: int, tp: str | None
    ) -> str:
        key = stable_id("TRANSITION_REFUSED", agent, str(msg_seq))
        body = {"agent": agent, "reason": why, "inbound_seq": msg_seq,
                "idp_id": rep.idp_id if rep else None, "executed_action": rep.executed_action if rep else None}
        await self.eventlog.append("TRANSITION_REFUSED", body, msg_id=key, traceparent=tp)
        log.warning("transition refused", agent=agent, reason=why, idp_id=body["idp_id"])
        await self.publisher.verdict(
            Verdict(
                verdict_id=stable_id("idp-transition-refused", key), verdict_class="denied", decision="reject",
                approver="policy", human_disposed=False, ts=now_rfc3339(), agent=agent,
                action_type=(rep.executed_action if rep else "idp.transition"), action_id=(rep.idp_id if rep else key),
                idp_id=rep.idp_id if rep else None, traceparent=tp,
                reason=Refusal(code="TRANSITION_REFUSED", reason=why),
            )
        )
        return f"refused:{why}"

"""Denials and human escalation of the IDP kernel (spec 003 §5.2, §5.4, §4.4, §6.3).

Split from ``gateway.kernel.service`` (issue 18): the enriched deny and the
mission-ref mismatch answers with their log events and verdicts, and HEM (a
binding moment to the mandate's principal through the moment desk, and the
answer that settles the session). The methods run on
:class:`gateway.kernel.service.KernelService`, whose state they share.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import msgspec

from gateway.kernel.eventlog import EventLog
from gateway.kernel.hem import attachment, hem_moment
from gateway.kernel.mandate import LAPSED_HOW, Mandate
from gateway.kernel.state import HemHold, KernelState, SessionEntry
from gateway.security.text import marked
from pgwcore.logs import get_logger
from subjects.idp import (
    EnrichedDeny,
    Idp,
    KernelResult,
    MismatchDetail,
)
from subjects.util import now_rfc3339, stable_id
from subjects.wire import BindingMoment, Refusal, Verdict

log = get_logger("pgw.kernel")


_DENY_REASONS = {
    "POLICY_DENY": "The governing policy does not permit {action} on this object in the declared context.",
    # POLICY_DENY by a forbid policy (the reason only: the code stays POLICY_DENY, spec 003 §6.2)
    "forbidden": "The governing policy forbids {action} on this object in the declared context; no human may "
                 "allow it, so it is not escalated (hem_available is false).",
    "MANDATE_SCOPE": "{action} is outside the scope of the presented mandate; no human may widen it, so it is not "
                     "escalated (hem_available is false): a mandate that grants it is needed.",
    "HEM_PENDING": "The session awaits a human decision; no transition proceeds until it is resolved.",
    "IDP_MISSION_REF_MISMATCH": "The IDP mission_ref does not match the mission bound to the mandate; see mismatch_detail.",
    "GATE_REQUIRED": "{action} may only execute through a kernel gate, which this gateway does not provide.",
    "HEM_UNAVAILABLE": "The IDP requires human judgment and no human escalation is available here.",
}


class Denials:
    """The deny and HEM methods of :class:`gateway.kernel.service.KernelService` (state lives on the service)."""

    gw: Any
    cfg: Any
    desk: Any
    state: KernelState
    eventlog: EventLog
    overdue: Any
    publisher: Any

    async def _deny(
        self, agent: str, idp: Idp, m: Mandate, code: str, idp_raw: Any, *, available: list[str],
        hem_available: bool, tp: str | None, submitted_seq: int | None = None, log_event: bool = False,
        mismatch: MismatchDetail | None = None, forbidden: bool = False,
    ) -> EnrichedDeny:
        why = "forbidden" if forbidden and code == "POLICY_DENY" else code
        reason = _DENY_REASONS.get(why, "The transition is not permitted now.").format(action=idp.requested_action)
        res = EnrichedDeny(
            timestamp=now_rfc3339(), deny_code=code, deny_reason=reason, idp_received=idp_raw,  # type: ignore[arg-type]
            available_actions=available, hem_available=hem_available,
            suggested_paths=self._paths(idp.requested_action, available) if code in ("POLICY_DENY", "MANDATE_SCOPE") else None,
            mismatch_detail=mismatch, idp_id=idp.idp_id, event_seq=submitted_seq,
        )
        if log_event:
            await self.eventlog.append(
                "CEDAR_DENY_RECORDED",
                {"idp_id": idp.idp_id, "so_id": idp.so_id, "session_id": idp.session_id, "agent": agent,
                 "requested_action": idp.requested_action, "deny_code": code, "available_actions": available,
                 "hem_available": hem_available, "idp_submitted_seq": submitted_seq},
                msg_id=stable_id("CEDAR_DENY_RECORDED", idp.so_id.lower(), idp.idp_id.lower()),
                traceparent=tp,
            )
        await self._deny_verdict(agent, idp.idp_id, idp.idp_id, code, reason, m.principal, tp, result="DENY")
        return res

    async def _mission_mismatch(self, agent: str, idp: Idp, m: Mandate, idp_raw: Any, tp: str | None) -> KernelResult:
        assert idp.mission_ref is not None and m.mission_ref is not None
        detail = MismatchDetail(expected_mission_ref=m.mission_ref, submitted_mission_ref=idp.mission_ref)
        # spec 003 §5.2(g): "MUST log IDP_MISSION_REF_MISMATCH_REJECTED".
        body = {"idp_id": idp.idp_id, "so_id": idp.so_id, "session_id": idp.session_id, "agent": agent,
                "principal": m.principal, "mismatch_detail": msgspec.to_builtins(detail), "idp": idp_raw,
                "audit_accessible": idp.audit_accessible}  # spec 003 §4.2, honoured by audit.py
        ev = await self.eventlog.append(
            "IDP_MISSION_REF_MISMATCH_REJECTED", body,
            msg_id=stable_id("IDP_MISSION_REF_MISMATCH_REJECTED", idp.so_id.lower(), idp.idp_id.lower()), traceparent=tp,
        )
        await self.state.apply("IDP_MISSION_REF_MISMATCH_REJECTED", body, ev.seq)
        sess, _ = await self.state.session(agent, idp.session_id)
        threshold = self.cfg.mismatch_hem_threshold
        escalate = bool(threshold) and self.cfg.hem_enabled and len(sess.mismatches) >= threshold and sess.state == "ACTIVE"
        # hem_available is false (spec 003 §6.2: "whether the agent may trigger HEM by
        # resubmitting with hem_urgency: REQUIRED"): it may not. A resubmission naming
        # the same wrong mission fails the same §5.2(g) check, which precedes Cedar and
        # HEM; a human is not asked to approve an action declared under a mission its
        # mandate does not name. The agent corrects mission_ref; repeated mismatches
        # reach a human through the threshold below.
        res = await self._deny(
            agent, idp, m, "IDP_MISSION_REF_MISMATCH", idp_raw, available=[],
            hem_available=False, tp=tp, mismatch=detail,
        )
        if escalate:
            # spec 003 §5.2(g): HEM_AGENT_ESCALATED after the configured number of mismatches.
            await self._escalate(agent=agent, principal=m.principal, idp=idp, trigger="MISSION_REF_MISMATCH_THRESHOLD",
                                 mandate_id=m.jti, tp=tp)
        return res

    async def _escalate(
        self, *, agent: str, principal: str, idp: Idp, trigger: str, mandate_id: str, cedar: str | None = None,
        verification: dict[str, Any] | None = None, tp: str | None = None, moment_id: str | None = None,
        retell: Callable[[BindingMoment], BindingMoment] | None = None, extra: dict[str, Any] | None = None,
        arguments: dict[str, Any] | None = None, mandate_exp: float | None = None,
    ) -> tuple[str, int]:
        """Escalate to the mandate's principal: log ``HEM_ESCALATED``, queue its moment on the
        session and on the hold of the governed object (every session of the agent on it is
        held until a human answers; docs/kernel.md "Session creation and the scope of a HEM
        block"), and dispatch the moment. ``retell`` adjusts the moment built by ``hem_moment``;
        ``arguments``: a gated action's arguments, shown as findings after SR-1 redaction (the
        principal approves exactly what the executor will be sent, docs/gate.md)."""
        from gateway.moment_record import HemContext

        moment_id = moment_id or self._moment_id(trigger, idp)
        body = {"idp_id": idp.idp_id, "so_id": idp.so_id if trigger != "MISSION_REF_MISMATCH_THRESHOLD" else None,
                "session_id": idp.session_id, "agent": agent, "principal": principal, "trigger": trigger,
                "moment_id": moment_id, "cedar": cedar, "requested_action": idp.requested_action,
                "scope": {"so_id": idp.so_id.lower(), "mandate_id": mandate_id,
                          **({"mandate_exp": mandate_exp} if mandate_exp is not None else {})}, **(extra or {})}
        if verification:
            body["verification"] = verification
        # §5.5.2 "the session enters HEM_PENDING immediately": the session moves together
        # with the event's append, not after its ack, so once the escalation is decided no
        # later step reservation goes through (a request that reserved its step first was
        # first). If the event cannot be logged the session is put back; the IDP's own
        # entry (HEM_URGENCY_REQUIRED) was written hem_pending by the caller.
        ev, prior = await asyncio.gather(
            self.eventlog.append("HEM_ESCALATED", body, msg_id=stable_id("HEM_ESCALATED", moment_id), traceparent=tp),
            self.state.escalate(body),
            return_exceptions=True,
        )
        if isinstance(ev, BaseException):
            if isinstance(prior, SessionEntry):
                with contextlib.suppress(Exception):
                    await self.state.unescalate(body, prior)
            raise ev
        if isinstance(prior, BaseException):
            raise prior
        sess, _ = await self.state.session(agent, idp.session_id)
        if arguments is not None:
            # SR-1 (spec 002 "Redaction"): the principal's surface never shows a configured secret,
            # whatever the agent put in the arguments; the executor still gets them as sent.
            # Characters she could not see are marked where they stand, not dropped (docs/gate.md).
            arguments = (await self.gw.stage_state.get()).redactor.graph(arguments, show=marked)
        moment = hem_moment(agent=agent, idp=idp, trigger=trigger, cedar=cedar, verification=verification,
                            arguments=arguments)
        # The arguments whole, as the card shows them on request (docs/gate.md "What the principal sees").
        attached = attachment(arguments) if arguments is not None else None
        if retell is not None:
            moment = retell(moment)
        await self.desk.dispatch(
            agent=agent, principal=principal, binding_moment=moment, envelope_id=idp.idp_id,
            correlation_id=idp.session_id, expires_in_s=self._hem_expiry(mandate_exp), traceparent=tp,
            hem=HemContext(idp.idp_id, idp.session_id, idp.requested_action,
                           permits=trigger == "HEM_URGENCY_REQUIRED"), moment_id=moment_id, conventional=attached,
        )
        log.info("hem escalated", agent=agent, idp_id=idp.idp_id, trigger=trigger, moment_id=moment_id,
                 session_state=sess.state)
        return moment_id, ev.seq

    def _hem_expiry(self, mandate_exp: float | None) -> float:
        """A moment's lifetime: ``hem_expires_in_s``, and no longer than the mandate it would permit under
        (with ``clock_skew_s``): an approval after that permits nothing (``_apply_hem``), so she is not left a
        question whose answer cannot count."""
        if mandate_exp is None:
            return self.cfg.hem_expires_in_s
        return max(1.0, min(self.cfg.hem_expires_in_s, mandate_exp + self.cfg.clock_skew_s - time.time()))

    # -- HEM decisions --------------------------------------------------------
    async def _on_hem_decision(self, record: Any, decision: str, resolution: Any) -> None:
        hem = record.hem
        if hem is None:
            return
        try:
            await self._apply_hem(record.agent, hem.session_id, hem.idp_id, record.moment_id, decision,
                                  option=_option(resolution), void=record.void)
        except Exception:
            log.exception("could not apply HEM decision", moment_id=record.moment_id)

    async def _judge_approval(self, record: Any) -> str | None:
        """``MomentDesk.judge_approval``: why her approval of the step this moment gates permits nothing now, or
        None (a moment the session no longer lists is not judged here: ``_apply_hem`` passes it over too)."""
        hem = record.hem
        sess, _ = await self.state.session(record.agent, hem.session_id)
        held = next((h for h in sess.hem_queue if h.moment_id == record.moment_id), None)
        if held is None or not _permits_step(held):
            return None
        return await self.approval_void(record.agent, held.so_id, held.mandate_id, held.mandate_exp)

    async def _apply_hem(
        self, agent: str, session_id: str, idp_id: str, moment_id: str, decision: str, held: HemHold | None = None,
        option: int | None = None, void: str | None = None,
    ) -> SessionEntry:
        """Log and act on a human's answer to one moment of the session's queue (spec 003
        §5.5.2): every answer, whichever moment it is and however many are queued. ``held``:
        the moment as the object's hold has it, for one its session does not list; ``option``:
        the option index she chose (2 and 3 of a gated step also grant a standing approval,
        gateway/kernel/scopes.py); ``void``: why her approval was void as she gave it, as the moment's record
        holds it (``_judge_approval``; what the agent was told): it stands, and the mandate is judged again as
        her answer is applied."""
        sess, _ = await self.state.session(agent, session_id)
        held = next((h for h in sess.hem_queue if h.moment_id == moment_id), held)
        if held is None:
            return sess
        so_id = await self.state.so_of(agent, idp_id) if held.trigger != "MISSION_REF_MISMATCH_THRESHOLD" else None
        body: dict[str, Any] = {"agent": agent, "session_id": session_id, "idp_id": idp_id, "so_id": so_id,
                                "moment_id": moment_id, "decision": decision, "trigger": held.trigger,
                                "principal": held.principal}
        if held.so_id:
            body["scope"] = {"so_id": held.so_id, "mandate_id": held.mandate_id}
        if option is not None:
            body["option_index"] = option
        if decision == "approve" and _permits_step(held):
            # Her approval permits the step under the mandate it was declared with: revoked meanwhile ("on every
            # gateway at once", docs/kernel.md), or expired, it permits nothing; her answer is logged as given,
            # with why it did not count (found by an attack from the docs: the step ran after the revocation).
            # The judgement made as she answered (what the agent was told) can only add a void: the mandate is
            # judged again now, since a crash or a failed callback can apply her answer much later, after a
            # revocation (a review: taking the stored judgement as final let such a step run).
            void = void or await self.approval_void(agent, held.so_id, held.mandate_id, held.mandate_exp)
            if void is not None:
                body["void"] = void
                decision, how = f"void:{void}", LAPSED_HOW[void]  # the gate's NOT_RUN words (gate.py)
                log.warning("an approval came after its mandate lapsed; nothing is permitted", agent=agent,
                            idp_id=idp_id, moment_id=moment_id, code=void)
                # The step's closure on the record: the desk publishes no verdict of an approval (the step's own
                # verdict follows its transition), and this one permits no transition (a review).
                await self._deny_verdict(agent, idp_id, moment_id, void,
                                         f"the principal approved after the mandate {how}; the approval permits nothing",
                                         held.principal, None)
        await self.eventlog.append("HEM_RESOLVED", body, msg_id=stable_id("HEM_RESOLVED", moment_id))
        settled = await self.state.resolve_hem(body)
        if decision == "approve" and so_id and held.trigger == "HEM_URGENCY_REQUIRED":
            got = await self.state.idp(so_id, idp_id)
            if got is not None:
                await self.overdue.opened(got[0], moment_id=moment_id)  # a human's permit awaits its report too
        if so_id and held.trigger == "HEM_URGENCY_REQUIRED":
            # A gated step (gateway/kernel/gate.py) runs now, or never.
            await self._gate_after_hem(so_id, idp_id, decision, option)  # type: ignore[attr-defined]
        return settled

    async def approval_void(self, agent: str, so_id: str | None, mandate_id: str, exp: float | None) -> str | None:
        """Why a principal's approval of a step under ``mandate_id`` permits nothing now, or None while the mandate
        stands: revoked or expired (``MandateVerifier.lapsed``; ``exp`` None: expiry not known), or ended by a human
        on the step's governed object ``so_id`` (a gap or a second report she did not approve, spec 003 §5.5.2:
        every session under it is refused, and so is an approval; found by a review): ``SESSION_TERMINATED``.
        The one check of her answer (``_apply_hem``) and of the gate's sweep, which dispatches an approved step a
        crash left unsent (gate.py)."""
        void = self.mandates.lapsed(mandate_id, exp)
        if void is None and so_id and mandate_id in (await self.state.hold(agent, so_id))[0].terminated:
            void = "SESSION_TERMINATED"
        return void

    async def _settle_decided(self, agent: str, holds: list[HemHold]) -> bool:
        """Apply the answers the desk already holds for these moments (its callback may not
        have run yet, or ran on an instance that failed); True if any was applied."""
        from gateway.moment_record import hem_decision_of

        applied = False
        for h in holds:
            found = await self.desk.get(h.principal, h.moment_id) if h.principal else None
            if found and found[0].status in ("resolved", "expired"):
                rec = found[0]
                decision = hem_decision_of(rec.resolution) if rec.status == "resolved" else "expired"
                await self._apply_hem(agent, h.session_id, h.idp_id, h.moment_id, decision, held=h,
                                      option=_option(rec.resolution) if rec.status == "resolved" else None,
                                      void=rec.void)
                applied = True
        return applied

    # -- verdicts ---------------------------------------------------------------
    async def _deny_verdict(
        self, agent: str, idp_id: str | None, key: str, code: str, reason: str, principal: str | None,
        tp: str | None, result: str = "REJECT",
    ) -> None:
        """DESIGN §6: IDP REJECT and Cedar DENY -> ``denied`` (approver policy)."""
        v = Verdict(
            verdict_id=stable_id("idp-denied", agent, key, code),
            verdict_class="denied", decision="reject", approver="policy", human_disposed=False,
            ts=now_rfc3339(), agent=agent, principal=principal, action_type="idp.transition",
            action_id=idp_id or key, idp_id=idp_id, reason=Refusal(code=code, reason=reason),
            traceparent=tp, details={"result": result},
        )
        await self.publisher.verdict(v)

    async def _malformed_verdict(self, agent: str, data: bytes, why: str, tp: str | None) -> None:
        """The ``denied`` verdict of a request refused ``REQUEST_MALFORMED`` before anything is committed: no
        IDP was read, so the request's bytes name it (``request_key``), and so its capsule."""
        await self._deny_verdict(agent, None, request_key(agent, data), "REQUEST_MALFORMED", why, None, tp)

    async def _verdict_failure(self, agent: str, data: bytes, tp: str | None) -> None:
        key = request_key(agent, data)
        await self.publisher.verdict(
            Verdict(
                verdict_id=stable_id("idp-engine-failure", agent, key), verdict_class="engine_failure",
                decision="reject", approver="policy", human_disposed=False, ts=now_rfc3339(), agent=agent,
                action_type="idp.transition", action_id=key, traceparent=tp,
                reason=Refusal(code="KERNEL_UNAVAILABLE", reason="the kernel could not evaluate the request"),
            )
        )


def request_key(agent: str, data: bytes) -> str:
    """A request's own id where no IDP names it (a refusal before the IDP was read): its agent and bytes."""
    return stable_id("request", agent, data.decode("utf-8", "replace"))


def _permits_step(held: HemHold) -> bool:
    """Whether her approval of ``held`` permits a step under a mandate (an approval the agent asked for,
    ``hem_urgency: REQUIRED``), which that mandate must still stand for."""
    return held.trigger == "HEM_URGENCY_REQUIRED" and bool(held.mandate_id)


def _option(resolution: Any) -> int | None:
    """The option index of an answer that chose one (None for free text, a veto or an expiry)."""
    from subjects.wire import OptionChoice

    return resolution.index if isinstance(resolution, OptionChoice) else None

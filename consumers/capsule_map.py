"""Verdict -> capsule: the mapping of DESIGN §6 (spec 004 §5), a pure function of the verdict.

:func:`capsule_from_verdict` maps a gateway :class:`~subjects.wire.Verdict`
to a capsule. It depends only on the verdict and static configuration
(operator, salt, parent id), so a verdict redelivered after a crash yields a
byte-identical capsule. Kernel transitions add their commitment check
(:mod:`consumers.capsule_kernel`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgspec

from consumers import capsule_kernel as kernel_facts
from consumers.capsule import (
    ACTION_TYPES,
    EFFECT_STATUSES,
    NEVER_DISPATCH,
    Built,
    Capsule,
    CapsuleError,
    Chain,
    ConstraintRecord,
    Disposition,
    EffectRecord,
    build_capsule_checked,
    json_digest,
    salted_digest,
    utc_z,
)
from subjects.wire import Verdict

_SNAKE = re.compile(r"[^a-z0-9]+")

def reason_object(v: Verdict) -> dict[str, Any] | None:
    """§5.4 structured reason: machine-readable members only, never free prose."""
    if v.reason is not None:
        rules = sorted(
            {(d.rule or "", d.path or "") for d in v.reason.details if d.rule or d.path}
        )
        return {"code": v.reason.code, "rules": [{"rule": r, "path": p} for r, p in rules]}
    if v.resolution_kind is not None:
        return {
            "resolution_kind": v.resolution_kind,
            "option_index": v.option_index,
            "text_digest": v.text_digest,
        }
    return None


# §9.1: constraint id / check_type values this profile does not seed carry a reverse-DNS prefix.
NAMESPACE = "io.pgw."
CHECK_TYPE_GATEWAY_RULE = NAMESPACE + "gateway_rule"


def _constraint_id(code: str) -> str:
    # §9.1: producer-local ids are namespaced; lowercase snake_case (§8.1).
    return NAMESPACE + (_SNAKE.sub("_", code.lower()).strip("_") or "unnamed")


def attestation_of(v: Verdict) -> str:
    """spec 004 §5.2 effect_attestation: ``gate_executed`` only where the kernel's gate dispatched the
    action and observed its result itself (gateway/kernel/gate.py: ``executed_action_source``
    ``kernel_dispatched``); every other effect is the runtime's claim."""
    d = v.details
    if d.get("effect_attestation") == "gate_executed" and d.get("executed_action_source") == "kernel_dispatched":
        return "gate_executed"
    return "runtime_claimed"


def _effect_record(v: Verdict, notes: list[str]) -> EffectRecord | None:
    """The effect as observed by the gateway: reported by the runtime (or observed by its gate), never upgraded."""
    vc = v.verdict_class
    if vc in NEVER_DISPATCH:
        if v.effect is not None:
            notes.append("effect_dropped_never_dispatch")
        return None
    e = v.effect
    if e is None:
        if vc == "errored":
            # §5.4.2: errored ran and threw; not_applicable would falsely assert nothing happened.
            return EffectRecord(type=v.action_type or "unknown", status="dispatched",
                                effect_attestation="runtime_claimed")
        return None
    status = e.status if e.status in EFFECT_STATUSES else "dispatched"
    if status != e.status:
        notes.append("effect_status_unrecognized")
    if vc == "errored" and status in ("confirmed", "planned"):
        status = "dispatched"  # state unknown: the least claim that is still true
        notes.append("effect_status_downgraded_errored")
    req = resp = None
    if e.request is not None and status != "planned":
        try:
            req = json_digest(e.request)
        except CapsuleError:
            notes.append("request_not_digestable")
    if e.response is not None and status in ("confirmed", "failed", "reverted"):
        try:
            resp = json_digest(e.response)
        except CapsuleError:
            notes.append("response_not_digestable")
    if status == "confirmed" and resp is None:
        # §5.2 confirmed-effect invariant: no confirmed without the observed response's digest.
        status = "dispatched"
        notes.append("effect_confirmed_without_response")
    return EffectRecord(
        type=e.type,
        status=status,  # type: ignore[arg-type]
        request_digest=req,
        response_digest=resp,
        external_ref=e.external_ref,
        irreversibility_class=e.irreversibility_class,
        effect_attestation=None if status == "planned" else attestation_of(v),
    )


def capsule_from_verdict(v: Verdict, **kw: Any) -> Capsule:
    """The capsule of one verdict (DESIGN §6); deterministic in its inputs.

    ``ledger_mode`` is ``chained`` exactly when the capsule carries a
    ``chain`` block (§5.3, §5.4.4). ``chained=True`` builds the legacy form
    whose ``ledger`` linkage :func:`attach_ledger` adds before it is signed.
    """
    return capsule_from_verdict_checked(v, **kw).capsule


def capsule_from_verdict_checked(
    v: Verdict,
    *,
    operator: str,
    salt: str,
    default_developer: str = "principal-gateway",
    authority: str | None = None,
    parent_capsule_id: str | None = None,
    chained: bool = False,
    fallback_ts: str | Callable[[], str | None] | None = None,
    identify: bool = True,
) -> Built:
    """:func:`capsule_from_verdict` with the normalized body (see :class:`Built`); ``identify``:
    see :func:`consumers.capsule.build_capsule_checked`."""
    notes: list[str] = []
    try:
        timestamp = utc_z(v.ts)
    except (ValueError, TypeError):
        # Still deterministic: the caller passes the verdict's stream time, fixed across redeliveries.
        if callable(fallback_ts):  # computed only when needed (the signer's stream time)
            fallback_ts = fallback_ts()
        if fallback_ts is None:
            raise CapsuleError("§5.1 timestamp", f"verdict ts {v.ts!r} is not RFC 3339") from None
        timestamp = utc_z(fallback_ts)
        notes.append("verdict_ts_unparseable")
    effect = _effect_record(v, notes)
    facts = kernel_facts.transition_facts(v)  # a kernel transition: its commitment check (issue 20)
    gap = facts is not None and facts.gap
    reason = kernel_facts.gap_reason(facts) if gap else reason_object(v)  # type: ignore[arg-type]
    reason_digest = salted_digest(salt, reason) if reason is not None else None
    vc: str | None = v.verdict_class
    if vc == "executed" and reason_digest is None:
        vc = None  # §5.4: legitimately absent for a clean executed verdict
    if gap:
        # The gate approved the declared action, not the one that ran, which now awaits the
        # principal (HEM): no one, human or policy, accepted what was executed (§5.4, §13).
        disp = Disposition.by_policy("needs_input", authority=authority, verdict_class=vc,
                                     reason_digest=reason_digest)
    elif v.approver == "human" and v.human_disposed:
        disp = Disposition.by_human(v.decision, verdict_class=vc, reason_digest=reason_digest)
    elif v.approver == "human":
        disp = Disposition(v.decision, "human", False, None, vc, reason_digest)
    else:
        disp = Disposition.by_policy(v.decision, authority=authority, verdict_class=vc,
                                     reason_digest=reason_digest)
    constraints = None
    if v.reason is not None:
        constraints = [
            ConstraintRecord(
                id=_constraint_id(v.reason.code),
                result="fail",
                blocking=v.decision == "reject",
                check_type=CHECK_TYPE_GATEWAY_RULE,  # §8.1, §9.1: a bare unseeded name is non-conforming
                severity="error",
                evidence_digest=salted_digest(salt, msgspec.to_builtins(v.reason)),
            )
        ]
    if facts is not None:
        constraints = [*(constraints or []), *transition_constraints(facts, salt, "effect_confirmed_without_response"
                                                                     in notes)]
    action_type = v.action_type if v.action_type in ACTION_TYPES else "decide"
    pgw = {
        "verdict_id": v.verdict_id,
        "action_kind": v.action_type,
        "agent": v.agent,
        "principal_digest": salted_digest(salt, v.principal) if v.principal else None,
        "envelope_id": v.envelope_id,
        "correlation_id": v.correlation_id,
        "moment_id": v.moment_id,
        "idp_id": v.idp_id,
        "untrusted": v.untrusted or None,
        "notes": notes,
    }
    if facts is not None:
        # §8.1: the transition's actions are the commitment check's content, bound by digest only
        # (the declared one is the action_type of the verdict; the executed one is the agent's string).
        del pgw["action_kind"]
        pgw.update(kernel_facts.pgw_members(facts))
    if "effect_confirmed_without_response" in notes and v.effect is not None:
        pgw["effect_status_reported"] = v.effect.status
    scope = v.details.get("approval_scope")
    if isinstance(scope, dict) and isinstance(scope.get("scope_id"), str):
        # The principal's standing approval that permitted (or is) this action (gateway/kernel/scopes.py):
        # its opaque id and kind only; the folder and the tool are hers, kept in the kernel's signed log.
        pgw["approval_scope"] = {"scope_id": scope["scope_id"], "kind": scope.get("kind")}
    chain = Chain(parent_capsule_id) if parent_capsule_id else None
    action_id = v.action_id or f"verdict:{v.verdict_id}"
    return build_capsule_checked(
        action_id=action_id,
        action_type=action_type,
        operator=operator,
        developer=v.agent or default_developer,
        timestamp=timestamp,
        decision_id=action_id,
        disposition=disp,
        effect=effect,
        chain=chain,
        constraints=constraints,
        pgw=pgw,
        ledger_pending=chained,
        identify=identify,
    )


def transition_constraints(facts: kernel_facts.TransitionFacts, salt: str,
                           unbound_here: bool) -> list[ConstraintRecord]:
    """§8.1 records of the kernel's checks on a transition: commitment match, confirmed binding."""
    out = [ConstraintRecord(
        id=kernel_facts.COMMITMENT_CHECK_ID, result="fail" if facts.gap else "pass", blocking=False,
        check_type=kernel_facts.COMMITMENT_CHECK_TYPE, severity="critical" if facts.gap else None,
        evidence_digest=salted_digest(salt, kernel_facts.commitment_evidence(facts)),
    )]
    if facts.reported_status == "confirmed" or unbound_here:
        # §5.2: reported confirmed, but no response to bind; the capsule says dispatched.
        out.append(ConstraintRecord(id=kernel_facts.BINDING_CHECK_ID, result="fail", blocking=False,
                                    check_type=kernel_facts.BINDING_CHECK_TYPE, severity="warning"))
    return out

"""What a kernel transition verdict adds to its capsule (spec 003 §5.5, spec 004 §5.2, §5.4; issue 20).

The kernel publishes one verdict per transition report, with the commitment
check it ran in ``Verdict.details`` (``match_result``, ``requested_action``,
``executed_action``; ``effect_status_reported`` when it could not keep the
status the runtime reported). The capsule records what actually happened:

- the declared and the executed action and the match result are bound by
  salted digest only (§8.1), never carried in clear: the executed action is
  a free string of the agent's;
- the commitment check is a Constraint Record (§8.1), ``pass`` or ``fail``,
  never blocking (it ran after the fact), its evidence bound by a salted digest;
- an ``IDP_COMMITMENT_GAP`` (spec 003 §5.5.2) carries its verdict class
  (§5.4.1: the action ran, so ``executed``, or ``errored``) and a salted
  ``reason_digest`` over a structured reason (§5.4: declared vs executed
  action and the match result, no prose; §13 salt). Its disposition is
  ``needs_input`` by policy: the gate approved the declared action, not the
  executed one, and the kernel has escalated the gap to the principal (HEM).
  No human approved what ran, so ``human_disposed`` is false (§5.4, §13);
- a status the runtime reported but the capsule may not claim (``confirmed``
  without a response to digest, §5.2) is kept beside the effect as
  ``pgw.effect_status_reported`` with a failing binding Constraint Record, so
  the capsule and the kernel's STATE_TRANSITIONED event describe the same
  report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from subjects.wire import Verdict

GAP = "IDP_COMMITMENT_GAP"  # spec 003 §5.5.2
MATCHED = "MATCHED"
COMMITMENT_CHECK_ID = "io.pgw.idp_commitment_match"  # §9.1 namespaced
COMMITMENT_CHECK_TYPE = "io.pgw.commitment_verification"
BINDING_CHECK_ID = "io.pgw.confirmed_effect_binding"
BINDING_CHECK_TYPE = "io.pgw.effect_binding"


@dataclass(frozen=True)
class TransitionFacts:
    match_result: str
    declared_action: str
    executed_action: str
    reported_status: str | None  # the runtime's status where the capsule had to record another (§5.2)

    @property
    def gap(self) -> bool:
        return self.match_result != MATCHED


def transition_facts(v: Verdict) -> TransitionFacts | None:
    """The commitment check of a kernel transition verdict, or None for any other verdict."""
    d = v.details
    mr, declared, executed = d.get("match_result"), d.get("requested_action"), d.get("executed_action")
    if not (isinstance(mr, str) and isinstance(declared, str) and isinstance(executed, str)):
        return None
    reported = d.get("effect_status_reported")
    return TransitionFacts(mr, declared, executed, reported if isinstance(reported, str) else None)


def gap_reason(f: TransitionFacts) -> dict[str, Any]:
    """§5.4 structured reason of a commitment gap: machine-readable members only."""
    return {
        "code": GAP,
        "match_result": f.match_result,
        "match_rule": "string_exact",  # spec 003 §5.5.3
        "declared_action": f.declared_action,
        "executed_action": f.executed_action,
    }


def commitment_evidence(f: TransitionFacts) -> dict[str, Any]:
    """The private evidence the commitment Constraint Record binds by (salted) digest (§8.1)."""
    return {"declared_action": f.declared_action, "executed_action": f.executed_action,
            "match_result": f.match_result}


def pgw_members(f: TransitionFacts) -> dict[str, Any]:
    """The ``pgw`` extension members (§9: payload-only) for a transition.

    §8.1: "The content a check evaluated MUST NOT appear in the public record;
    it is bound by digest only." The declared action, the executed action (a
    free string of the agent's) and the match result are the commitment
    check's content: they are in the salted ``evidence_digest`` of its
    Constraint Record (and the gap's ``reason_digest``), whose ``result``
    (pass / fail) is the check's public verdict, and never here in clear.
    """
    out: dict[str, Any] = {}
    if f.reported_status is not None:
        out["effect_status_reported"] = f.reported_status
    return out

"""The human-escalation binding moment the gateway builds itself (DESIGN §5.3).

Spec 000 §5 eight slots: the synopsis states the action and the agent's
declared goal in one sentence; the findings carry the reasoning basis and
confidence (and, for a commitment gap, the verification record with
``match_result: IDP_COMMITMENT_GAP``, spec 003 §5.5.2(b)); options are
approve (index 0) and deny (index 1), both with reasoning; both hatches open.
The gateway has no stake in the answer, so the recommended option is the
conservative one, deny, and the offer says so.
"""

from __future__ import annotations

from typing import Any

from subjects.idp import Idp
from subjects.wire import BindingMoment, Hatches, MomentMeta, MomentOption, Question

_TRIGGER_TEXT = {
    "HEM_URGENCY_REQUIRED": "the agent declared that it requires human judgment (hem_urgency REQUIRED)",
    "MISSION_REF_MISMATCH_THRESHOLD": "the agent's declarations repeatedly named the wrong mission",
    "IDP_COMMITMENT_GAP": "the agent executed an action other than the one it declared",
}


def _clip(text: str, n: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def hem_moment(
    *,
    agent: str,
    idp: Idp,
    trigger: str,
    cedar: str | None = None,
    previous_deny: str | None = None,
    verification: dict[str, Any] | None = None,
) -> BindingMoment:
    action = idp.requested_action
    goal = idp.declared_goal.description if idp.declared_goal else "no goal declared (IDP_THIN)"
    if trigger == "IDP_COMMITMENT_GAP" and verification:
        synopsis = _clip(
            f"Agent {agent} declared {action} to pursue \"{_clip(goal, 200)}\" but executed "
            f"{_clip(str(verification.get('executed_action')), 100)} instead."
        )
        stem = f"Should agent {agent} be allowed to continue session {_clip(idp.session_id, 64)}?"
    elif trigger == "MISSION_REF_MISMATCH_THRESHOLD":
        synopsis = _clip(
            f"Agent {agent} asks to perform {action} to pursue \"{_clip(goal, 200)}\" under a mission "
            "its mandate does not name."
        )
        stem = f"Should agent {agent} be allowed to continue session {_clip(idp.session_id, 64)}?"
    else:
        synopsis = _clip(f"Agent {agent} asks to perform {action} to pursue \"{_clip(goal, 300)}\".")
        stem = f"Should agent {agent} perform {action} on object {idp.so_id}?"
    findings = [f"Escalated because {_TRIGGER_TEXT.get(trigger, trigger)}."]
    if idp.reasoning_basis is not None:
        findings.append(
            f"Reasoning basis {idp.reasoning_basis.type}: {_clip(idp.reasoning_basis.description, 600)}"
        )
    else:
        findings.append("Reasoning basis: UNSPECIFIED (thin profile).")
    conf = f"{idp.confidence_level:.2f}" if idp.confidence_level is not None else "not stated (0.5 recorded)"
    findings.append(f"Declared confidence: {conf}.")
    if cedar:
        findings.append(f"Policy evaluation alone would {'permit' if cedar == 'PERMIT' else 'deny'} this action.")
    if previous_deny:
        findings.append(f"This follows a denial of the same action in this session ({previous_deny}).")
    if verification:
        # spec 003 §5.5.2(b): the Escalation Request includes the verification record itself,
        # match_result first; every field, as signed.
        findings.append(f"Commitment verification record: match_result {verification.get('match_result')}.")
        findings += [f"Verification record {k}: {_clip(str(v), 200)}" for k, v in verification.items() if k != "match_result"]
    if trigger == "HEM_URGENCY_REQUIRED":
        approve_reason = f"The declared goal and reasoning justify {action} this once."
        deny_reason = f"{action} should not run; the agent keeps its session and can choose another action."
        offer = "Approving permits exactly this declared step once; the gateway recommends deny unless you are sure."
    else:
        approve_reason = "You have checked the divergence and accept it; the session continues."
        deny_reason = "The divergence is not acceptable; the session ends and the agent must start again."
        offer = "Approving lets the session continue; denying ends it; the gateway recommends deny unless you are sure."
    return BindingMoment(
        synopsis=synopsis,
        findings=findings,
        recommendations=[],
        offer=offer,
        question=Question(
            stem=stem,
            options=[
                MomentOption(label="Approve", reasoning=approve_reason),
                MomentOption(label="Deny", reasoning=deny_reason),
            ],
            recommended_idx=1,
            hatches=Hatches(free_text=True, dialogue=True),
        ),
        meta=MomentMeta(decision_class="idp.hem"),
    )

"""The human-escalation binding moment the gateway builds itself (DESIGN §5.3).

Spec 000 §5 eight slots, under the same grammar and lints as an agent's
moment (``_disciplined``; a test runs them over every trigger): the synopsis
commits to the gateway's position in one answer-first sentence (§6.1: deny
the action, or end the session); the findings carry the declared action and
goal, the reasoning basis and confidence (and, for a commitment gap, the
verification record with ``match_result: IDP_COMMITMENT_GAP``, spec 003
§5.5.2(b)); the recommendations are concrete moves (§6.3); options are
approve (index 0) and deny (index 1), both with reasoning; both hatches open.
The gateway has no stake in the answer, so the recommended option is the
conservative one, deny.
"""

from __future__ import annotations

from typing import Any

import msgspec

from subjects.constraints import MAX_LIST_ITEMS
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


# The findings that show a gated action's arguments (docs/gate.md "What the principal sees"): at most
# this many, each at most ARG_CHARS characters, so with the other findings the moment stays within the
# grammar of spec 000 (at most MAX_LIST_ITEMS findings of at most 2,000 characters each).
MAX_ARG_FINDINGS = 12
ARG_CHARS = 600


def _json(value: Any) -> str:
    try:
        return msgspec.json.encode(value).decode()
    except (TypeError, msgspec.EncodeError):
        return repr(value)


def argument_findings(arguments: dict[str, Any]) -> list[str]:
    """What a gated action will be sent to its executor with, as findings the principal reads.

    The arguments of an MCP tool call through ``pgw mcp-gate`` have the shape
    ``{"tool": NAME, "arguments": {...}}`` (the gate's own executor reads it): the
    tool is named, then each of its arguments. Any other action's arguments are
    listed one per finding. Each value is its JSON, clipped to ``ARG_CHARS``; past
    ``MAX_ARG_FINDINGS`` the rest are counted, not shown. The caller redacts first
    (the gateway's SR-1 redactor): nothing here reads a secret.
    """
    out: list[str] = []
    args = arguments
    tool = arguments.get("tool")
    if isinstance(tool, str) and isinstance(arguments.get("arguments"), dict) and set(arguments) == {"tool", "arguments"}:
        out.append(f"Tool to call: {_clip(tool, 200)}.")
        args = arguments["arguments"]
        what = "Tool argument"
    else:
        what = "Argument"
    if not args:
        out.append("The action is called with no arguments." if what == "Argument" else "The tool is called with no arguments.")
        return out
    items = list(args.items())
    room = MAX_ARG_FINDINGS - len(out)
    shown = items if len(items) <= room else items[: room - 1]
    out += [f"{what} {_clip(str(k), 100)}: {_clip(_json(v), ARG_CHARS)}" for k, v in shown]
    if len(shown) < len(items):
        out.append(f"{len(items) - len(shown)} more arguments are not shown here; the kernel's dispatch record keeps them all.")
    return out


def hem_moment(
    *,
    agent: str,
    idp: Idp,
    trigger: str,
    cedar: str | None = None,
    previous_deny: str | None = None,
    verification: dict[str, Any] | None = None,
    arguments: dict[str, Any] | None = None,
) -> BindingMoment:
    action = idp.requested_action
    goal = idp.declared_goal.description if idp.declared_goal else "no goal declared (IDP_THIN)"
    # spec 000 §6.1: the synopsis commits to the gateway's position (answer-first), it does not restate
    # the request; the request itself is in the stem and the findings. The position is the
    # recommended option (slot 7): deny, the conservative one, since the gateway has no stake.
    if trigger == "HEM_URGENCY_REQUIRED":
        position = "the agent asked for a human decision, and the gateway approves nothing on your behalf"
        stem = f"Should agent {agent} perform {_clip(action, 100)} on object {idp.so_id}?"
    else:
        position = {
            "IDP_COMMITMENT_GAP": "the agent executed a different action than the one it declared",
            "MISSION_REF_MISMATCH_THRESHOLD": "the agent's declarations repeatedly named a mission its mandate does not cover",
        }.get(trigger, "the kernel escalated it and the gateway approves nothing on your behalf")
        stem = f"Should agent {agent} be allowed to continue session {_clip(idp.session_id, 64)}?"
    if trigger == "HEM_URGENCY_REQUIRED":
        verb, subject = "Deny", f"{_clip(action, 100)} for agent {agent}"
    else:
        verb, subject = "End", f"session {_clip(idp.session_id, 64)} of agent {agent}"
    synopsis = _clip(f"{verb} {subject}: {position}.")
    findings = [f"Escalated because {_TRIGGER_TEXT.get(trigger, trigger)}."]
    findings.append(f"Declared action {_clip(action, 200)}, to pursue: \"{_clip(goal, 300)}\".")
    if trigger == "MISSION_REF_MISMATCH_THRESHOLD":
        findings.append("The mission named in the declarations is not one the agent's mandate names.")
    if idp.reasoning_basis is not None:
        findings.append(
            f"Reasoning basis {idp.reasoning_basis.type}: {_clip(idp.reasoning_basis.description, 600)}"
        )
    else:
        findings.append("Reasoning basis: UNSPECIFIED (thin profile).")
    conf = f"{idp.confidence_level:.2f}" if idp.confidence_level is not None else "not stated (0.5 recorded)"
    findings.append(f"Declared confidence: {conf}.")
    if arguments is not None:
        findings += argument_findings(arguments)
    if cedar:
        findings.append(f"Policy evaluation alone would {'permit' if cedar == 'PERMIT' else 'deny'} this action.")
    if previous_deny:
        findings.append(f"This follows a denial of the same action in this session ({previous_deny}).")
    if verification:
        # spec 003 §5.5.2(b): the Escalation Request includes the verification record itself,
        # match_result first; every field, as signed.
        findings.append(f"Commitment verification record: match_result {verification.get('match_result')}.")
        findings += [f"Verification record {k}: {_clip(str(v), 200)}" for k, v in verification.items() if k != "match_result"]
    # spec 000 §6.2 / the grammar: at most MAX_LIST_ITEMS findings (argument_findings keeps within it).
    findings = findings[:MAX_LIST_ITEMS]
    if trigger == "HEM_URGENCY_REQUIRED":
        approve_reason = "The declared goal and reasoning justify this action this once."
        deny_reason = "The action does not run; the agent keeps its session and can choose another action."
        offer = "Ask for detail on any finding; approving permits exactly this declared step once."
        # spec 000 §6.3: concrete moves, each one that would change state if taken.
        recommendations = [
            "Deny the declared action; the agent keeps its session and can propose another step.",
            "Approve it only if the declared goal is one you set and the action is the step it needs.",
        ]
    else:
        approve_reason = "You have checked the divergence and accept it; the session continues."
        deny_reason = "The divergence is not acceptable; the session ends and the agent must start again."
        offer = "Ask for detail on any finding; approving lets the session continue, denying ends it."
        recommendations = [
            "Deny: end the session, so that the agent must start again under a correct declaration.",
            "Approve only after you have checked the divergence in the findings and accept it.",
        ]
    moment = BindingMoment(
        synopsis=synopsis,
        findings=findings,
        recommendations=recommendations,
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
    return _disciplined(moment, agent, "Deny this escalated request" if verb == "Deny" else "End this session")


def _disciplined(moment: BindingMoment, agent: str, plain_position: str) -> BindingMoment:
    """``moment`` held to the same grammar and lints as an agent's (spec 000 §6, §7.1).

    The stem and synopsis quote the agent's own action name and session id, which are free
    text: where one of them would trip a lint (a hedge word, a full stop followed by a capital,
    a leading word), that slot falls back to wording without it; the findings still carry it.
    """
    from gateway.stages import lints

    flagged = {d.path for _, d in lints.check(moment)}
    if f"{lints.P}.synopsis" in flagged:
        moment.synopsis = f"{plain_position}: the gateway approves nothing on your behalf."
    if f"{lints.P}.question.stem" in flagged:
        moment.question.stem = f"Should agent {agent} be allowed to go ahead as declared in the findings?"
    if lints.check(moment):  # the agent token itself trips a lint: no agent-authored text at all
        moment.question.stem = "Should the agent be allowed to go ahead as declared in the findings?"
    return moment

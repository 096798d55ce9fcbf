"""The human-escalation binding moment the gateway builds itself (DESIGN §5.3).

Spec 000 §5 eight slots, under the same grammar and lints as an agent's
moment (``_disciplined``; a test runs them over every trigger). The card
tells the principal the truth about who asks what (docs/gate.md "What the
principal sees"):

- who recommends: the gateway's policy, not the agent (the agent wants the
  action). The gateway has no stake in the answer, so the recommended option
  is the conservative one, deny, and the synopsis commits to it answer-first
  (§6.1) as the policy's recommendation, never as a decision already taken;
- what the agent asks to do, in plain words: the tool or action and the
  argument that matters, a path first, in the stem (§6.5, no UUID of the
  governed object);
- why she is asked: the rule that escalated it (the policy does not allow it
  on its own, or the agent asked, or the kernel saw a gap), in words, first
  among the findings;
- no protocol jargon for her: the trigger codes, reasoning-basis types, ids
  and the signed verification record stay in the kernel's ``HEM_ESCALATED``
  event for auditors; the one exception is the ``match_result`` a commitment
  gap must surface to the resolving principal (spec 003 §5.5.2(b));
- the arguments the executor will be sent, each as a finding (a path first):
  secrets the gateway's detector finds redacted besides the configured ones
  (``gateway.security.secret_scan``; the caller applies SR-1 first), every
  character she could not see marked ``⟦U+XXXX⟧`` where it stands
  (``gateway.security.text.marked``), a long value previewed with its length
  said and attached whole to the card (:func:`attachment`, the surface
  item's conventional payload), so nothing she approves is silently clipped.

Options are Approve (index 0) and Deny (index 1), both with reasoning; both
hatches open. On the approval moment of a gated call whose asked path is a
clean path the kernel adds two more after them (``scopes.with_options``):
Allow for this session (2) and Allow for an hour (3), the standing approvals
of docs/gate.md, which the principal lists and revokes on her surfaces.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.security.secret_scan import redact_graph
from gateway.security.text import marked, quoted
from subjects.constraints import MAX_LIST_ITEMS
from subjects.gate import PATH_KEYS
from subjects.idp import Idp
from subjects.wire import BindingMoment, Hatches, MomentMeta, MomentOption, Question

# Why she is asked, per trigger (the cedar outcome refines HEM_URGENCY_REQUIRED, see _why).
WHY = "Why you are asked: "
_TRIGGER_TEXT = {
    "MISSION_REF_MISMATCH_THRESHOLD": "agent {agent}'s requests repeatedly named a task that its permission does not cover, "
                                      "so the gateway stopped the session until you decide.",
    "IDP_COMMITMENT_GAP": "agent {agent} said it would do {declared} but did {executed}, "
                          "so the gateway stopped the session until you decide.",
    "TRANSITION_REPORTED_TWICE": "agent {agent} reported doing two different things for one step it declared, "
                                 "so the gateway stopped the session until you decide.",
}


def _clip(text: str, n: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


# The findings that show a gated action's arguments (docs/gate.md "What the principal sees"): at most
# this many, each previewing at most ARG_CHARS characters (its length said, the whole value attached),
# so with the other findings the moment stays within the grammar of spec 000 (at most MAX_LIST_ITEMS
# findings of at most 2,000 characters each).
MAX_ARG_FINDINGS = 12
ARG_CHARS = 300
MAX_PATHS_ASKED = 3  # paths named in the question (subjects.gate.PATH_KEYS); past them it counts the rest


def _json(value: Any) -> str:
    try:
        return msgspec.json.encode(value).decode()
    except (TypeError, msgspec.EncodeError):
        return repr(value)


class Shown:
    """A gated action's arguments as the principal reads them: secrets redacted, invisibles marked, a path first."""

    def __init__(self, arguments: dict[str, Any]) -> None:
        self.kinds: list[str] = []
        args = redact_graph(arguments, self.kinds)
        tool = args.get("tool")
        if isinstance(tool, str) and isinstance(args.get("arguments"), dict) and set(args) == {"tool", "arguments"}:
            self.tool: str | None = marked(tool)
            args = args["arguments"]
        else:
            self.tool = None
        self.hidden = False
        items: list[tuple[str, str]] = []
        for k, v in args.items():
            text = v if isinstance(v, str) else _json(v)
            shown = marked(text)
            self.hidden = self.hidden or shown != text
            items.append((marked(str(k)), shown if not isinstance(v, str) else _json(shown)))
        self.raw_text = {marked(str(k)): marked(v if isinstance(v, str) else _json(v)) for k, v in args.items()}
        # Marked here or already by SR-1's rendering (the kernel redacts with show=marked first).
        self.hidden = self.hidden or any("⟦U+" in k + v for k, v in self.raw_text.items())
        first = [i for i in items if i[0].lower() in PATH_KEYS]
        self.items = first + [i for i in items if i not in first]
        # Every path it names, each once: the question names them all, since which one a tool acts on is
        # the tool's to decide (a card that named the first only was approved for a file the tool never
        # wrote, while it wrote the other; found by an attack from the docs).
        self.paths = list(dict.fromkeys(self.raw_text[k] for k, _ in first if k in self.raw_text))


def argument_findings(arguments: dict[str, Any], shown: Shown | None = None) -> list[str]:
    """What a gated action will be sent to its executor with, as findings the principal reads.

    The arguments of an MCP tool call through ``pgw mcp-gate`` have the shape
    ``{"tool": NAME, "arguments": {...}}`` (the gate's own executor reads it): the
    tool is named, then each of its arguments, a path first. Any other action's
    arguments are listed one per finding. Each value is its JSON; one longer than
    ``ARG_CHARS`` is previewed with its length said, and past ``MAX_ARG_FINDINGS``
    the rest are counted: every value is attached whole (:func:`attachment`). The
    caller applies SR-1 first; secrets the detector finds are redacted here.
    """
    s = shown or Shown(arguments)
    out: list[str] = []
    if s.tool is not None:
        out.append(f"Tool to call: {_clip(s.tool, 200)}.")
        what = "Tool argument"
    else:
        what = "Argument"
    if not s.items:
        out.append("The action is called with no arguments." if what == "Argument" else "The tool is called with no arguments.")
        return out
    room = MAX_ARG_FINDINGS - len(out)
    shown_items = s.items if len(s.items) <= room else s.items[: room - 1]
    for k, v in shown_items:
        name = _clip(k, 100)
        if len(v) <= ARG_CHARS:
            out.append(f"{what} {name}: {v}")
        else:
            out.append(f"{what} {name} ({len(s.raw_text.get(k, v)):,} characters; the first {ARG_CHARS} here, "
                       f"the whole value attached to this card): {v[:ARG_CHARS]}…")
    if len(shown_items) < len(s.items):
        out.append(f"{len(s.items) - len(shown_items)} more arguments are attached to this card in full.")
    if s.kinds:
        out.append(f"Shown as [REDACTED]: what looks like a secret ({', '.join(s.kinds[:4])}); "
                   "the tool still receives it as the agent sent it.")
    if s.hidden:
        out.append("Characters you could not see are shown as ⟦U+…⟧ where they stand; they will be sent as they are.")
    return out


def attachment(arguments: dict[str, Any], shown: Shown | None = None) -> dict[str, Any]:
    """The whole arguments as the card shows them on request (the surface item's ``conventional``).

    ``{"arguments": [{"name", "text", "chars"}], "tool"?}``: each value as text (a string as it
    is, anything else its JSON), redacted and marked as in the findings, never clipped.
    """
    s = shown or Shown(arguments)
    out: dict[str, Any] = {"arguments": [{"name": k, "text": s.raw_text[k], "chars": len(s.raw_text[k])}
                                         for k, _ in s.items if k in s.raw_text]}
    if s.tool is not None:
        out["tool"] = s.tool
    return out


def _ask(action: str, shown: Shown | None) -> str:
    """What the agent asks to do, in plain words: the tool (or action) and the path it touches."""
    act = marked(_clip(action, 100))
    if shown is None:
        return f"do {act}"
    verb = f"run {_clip(shown.tool, 100)}" if shown.tool is not None else f"do {act}"
    if not shown.paths:
        return verb
    # Each path as a JSON string, as the findings show it: a quote in the agent's text is escaped (and one
    # drawn like a quote marked), so it cannot close the gateway's quotes and write a sentence of its own into
    # the question (found by an attack from the docs: 'todo.txt" (to add one line ...). The second name is
    # only ... read, not written: "').
    named = [quoted(_clip(p, 160)) for p in shown.paths[:MAX_PATHS_ASKED]]
    more = len(shown.paths) - len(named)
    if more:
        named.append(f"{more} more path{'s' if more > 1 else ''} (the findings list each)")
    return f"{verb} on " + (named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1])


def _why(trigger: str, agent: str, action: str, cedar: str | None, verification: dict[str, Any] | None) -> str:
    act = marked(_clip(action, 100))
    if trigger == "HEM_URGENCY_REQUIRED":
        if cedar == "DENY":
            return (f"{WHY}the gateway's policy does not allow {act} for agent {agent} on its own, "
                    "so the request asks for your approval instead of being refused.")
        if cedar == "PERMIT":
            return f"{WHY}the gateway's policy would allow {act}, but agent {agent} asked for your decision before it acts."
        return f"{WHY}agent {agent} asked for your decision before it acts."
    executed = marked(_clip(str((verification or {}).get("executed_action", "another action")), 100))
    text = _TRIGGER_TEXT.get(trigger, "the gateway's kernel stopped the session until you decide.")
    return WHY + text.format(agent=agent, declared=act, executed=executed)


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
    shown = Shown(arguments) if arguments is not None else None
    gated = trigger == "HEM_URGENCY_REQUIRED"
    # spec 000 §6.1: the synopsis commits to the recommended option (slot 7), deny, as the gateway's
    # policy's recommendation (the agent wants the action); the request itself is in the stem.
    if gated:
        ask = _ask(action, shown)
        stem = f"Should agent {agent} {ask}?"
        synopsis = _clip(f"The gateway's policy recommends Deny: agent {agent} asks to {ask}, "
                         "and nothing runs unless you approve.")
    else:
        stem = f"Should agent {agent} be allowed to continue this session?"
        synopsis = _clip("The gateway's policy recommends Deny, which ends this session: "
                         "the agent must start again under a correct declaration.")
    findings = [_why(trigger, agent, action, cedar, verification)]
    if trigger == "IDP_COMMITMENT_GAP" and verification:
        # spec 003 §5.5.2(b): match_result IDP_COMMITMENT_GAP "clearly surfaced to the resolving
        # principal"; the whole signed record is in HEM_ESCALATED (``verification``) for auditors.
        findings.append(f"The kernel's signed check of this step says match_result "
                        f"{_clip(str(verification.get('match_result')), 40)}: what was declared and what ran differ.")
    goal = idp.declared_goal.description if idp.declared_goal else None
    findings.append(f"The agent's stated goal: \"{marked(_clip(goal, 300))}\"." if goal
                    else "The agent stated no goal for this step.")
    if idp.reasoning_basis is not None:
        findings.append(f"The agent's reasoning: \"{marked(_clip(idp.reasoning_basis.description, 600))}\"")
    if idp.confidence_level is not None:
        findings.append(f"The agent says it is {round(idp.confidence_level * 100)}% confident in this step.")
    if arguments is not None:
        findings += argument_findings(arguments, shown)
    if verification:
        # spec 003 §5.5.2(b): the Escalation Request includes the verification record itself; every field
        # as signed, in one finding labelled for auditors, last (the plain account is first).
        findings.append(f"For auditors, the kernel's signed verification record: {_clip(_json(verification), 1800)}")
    if previous_deny:
        findings.append(f"This follows a denial of the same action in this session ({previous_deny}).")
    # spec 000 §6.2 / the grammar: at most MAX_LIST_ITEMS findings (argument_findings keeps within it).
    findings = findings[:MAX_LIST_ITEMS]
    if gated:
        approve_reason = "It runs once, exactly with the arguments shown."
        deny_reason = "Nothing runs; the agent is told you said no and keeps its session."
        offer = "Ask for detail on any finding; approving runs exactly this call once, with the arguments shown."
        # spec 000 §6.3: concrete moves, each one that would change state if taken.
        recommendations = [
            "Deny it unless you set this goal yourself and every argument is what you expect.",
            "Approve only after reading the arguments in full.",
            "Answer in your own words to say what should change; the agent gets your words and nothing runs.",
        ]
    else:
        approve_reason = "You have checked what the agent did and accept it; the session continues."
        deny_reason = "The session ends and the agent must start again."
        offer = "Ask for detail on any finding; approving lets the session continue, denying ends it."
        recommendations = [
            "Deny: end the session, so that the agent must start again under a correct declaration.",
            "Approve only after you have checked what it did and accept it.",
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
        # For the record and a surface's choice of style (spec 000 §6.9); surfaces do not show it
        # to the principal on a gateway-made moment (docs/surfaces.md).
        meta=MomentMeta(decision_class="idp.hem"),
    )
    return _disciplined(moment, agent, "The gateway's policy recommends Deny" if gated else "The gateway's policy recommends ending this session")


def held_report_moment(moment: BindingMoment, agent: str, executed: str) -> BindingMoment:
    """The moment of a transition report the kernel refused while the session waits on you (spec 003
    §4.4, §5.5.2): what happened, first among the findings of the moment ``hem_moment`` built (its
    synopsis and question, ending the session or letting it continue, stand)."""
    because = (f"{WHY}while this session was stopped for your decision, agent {agent} reported doing "
               f"{marked(_clip(executed, 100))} under a permission it took before; the gateway refused the report "
               "(it is not recorded as done) and keeps the session stopped until you decide.")
    findings = [because, *(f for f in moment.findings if not f.startswith(WHY))]
    return msgspec.structs.replace(moment, findings=findings)


def held_report_notice(agent: str, executed: str) -> str:
    """What the principal is told of a report the kernel refused after she ended the session (spec 003
    §5.5.2): nothing is left to decide, so it is a notice, not a moment."""
    return (f"After you ended this session, agent {agent} reported doing {marked(_clip(executed, 100))} under a "
            "permission it took before. The gateway refused the report (it is not recorded as done) and the "
            "session stays ended. Nothing is asked of you.")


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

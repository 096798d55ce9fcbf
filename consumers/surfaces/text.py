"""Render plans as terminal text (spec 000 §9.2: "an arrow-key picker with the
escape hatches bound to distinct keys").

Pure functions of a plan: the terminal surface calls them on every redraw,
and tests call them directly. Colour is optional (ANSI SGR); the marks that
carry meaning (``★ recommended``, ``UNTRUSTED``, ``BLOCKED``) are text, so
they survive a monochrome terminal, a screen reader and a log file.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from consumers.surfaces.model import (
    AuthorizationPlan,
    ClarificationPlan,
    DecisionPlan,
    NoticePlan,
    Plan,
    WithdrawPlan,
)

if TYPE_CHECKING:
    from subjects.approvals import StandingApproval

HATCH_KEYS = {"free_text": "f", "dialogue": "d"}
WHOLE_KEY = "w"  # shows a gateway-made moment's arguments in full (and hides them again)
RECOMMENDER = {"agent": "the agent", "gateway": "the gateway's policy"}
STANDING_KEY = "s"  # her standing approvals: list them, revoke one (docs/gate.md "Standing approvals")
STANDING_HELP = "↑/↓ choose · r revoke · s or Esc back · q quit"
STANDING_KIND = {"session": "Allow for this session", "hour": "Allow for an hour"}

_SGR = {
    "bold": "1",
    "dim": "2",
    "rev": "7",
    "red": "31",
    "green": "32",
    "yellow": "33",
    "cyan": "36",
    "redbg": "41;97;1",
    "yellowbg": "43;30;1",
}


class Style:
    def __init__(self, color: bool) -> None:
        self.color = color

    def __call__(self, text: str, *styles: str) -> str:
        styles = tuple(s for s in styles if s)
        if not self.color or not styles:
            return text
        codes = ";".join(_SGR[s] for s in styles)
        return f"\x1b[{codes}m{text}\x1b[0m"


def _wrap(text: str, width: int, indent: str = "", first: str | None = None) -> list[str]:
    lines: list[str] = []
    for para in text.splitlines() or [""]:
        lines += textwrap.wrap(
            para,
            width=max(20, width),
            initial_indent=first if first is not None and not lines else indent,
            subsequent_indent=indent,
            replace_whitespace=False,
        ) or [indent]
    return lines


def header_line(plan: Plan, st: Style) -> list[str]:
    out = [st(f"from agent {plan.agent}", "dim") + (st(f"  ·  {plan.created_at}", "dim") if plan.created_at else "")]
    if plan.untrusted:
        out.insert(
            0,
            st(" UNTRUSTED ", "redbg")
            + st(" built from untrusted content: check it before you act on it", "red"),
        )
    return out


def render_decision(plan: DecisionPlan, st: Style, width: int, selected: int | None, whole: bool = False) -> list[str]:
    out = header_line(plan, st)
    if plan.hem:
        out.append(st(f"The gateway asks your approval before agent {plan.agent} acts.", "yellow"))
    if plan.expires_at:
        out.append(st(f"Answer before {plan.expires_at}", "yellow"))
    if plan.decision_class and plan.recommended_by == "agent":
        # A gateway-made moment's class (idp.hem) is for the record, not for the principal.
        out.append(st(f"decision class: {plan.decision_class}", "dim"))
    out.append("")
    if plan.calibration_note:
        out += [st(line, "yellow") for line in _wrap(f"Note: {plan.calibration_note}", width)]
    # spec 000 §9.1: all four briefing slots, never dropped to save space.
    out += [st(line, "bold") for line in _wrap(plan.synopsis, width)]
    out.append("")
    out.append(st("Findings", "cyan"))
    out += [ln for f in plan.findings for ln in _wrap(f, width, "    ", "  • ")] or ["  (none)"]
    if plan.attachments:
        chars = sum(a.chars for a in plan.attachments)
        if whole:
            out.append(st(f"Arguments in full ({chars:,} characters; [{WHOLE_KEY}] hides them)", "cyan"))
            for a in plan.attachments:
                out.append(st(f"  {a.name} ({a.chars:,} characters):", "bold"))
                out += _wrap(a.text, width, "    ", "    ")
        else:
            out.append(st(f"  [{WHOLE_KEY}] show the arguments in full ({chars:,} characters)", "dim"))
    out.append(st("Recommendations", "cyan"))
    out += [ln for r in plan.recommendations for ln in _wrap(r, width, "    ", "  • ")] or ["  (none)"]
    out += [st(ln, "dim") for ln in _wrap(plan.offer, width)]
    out.append("")
    out += [st(ln, "bold") for ln in _wrap(plan.stem, width)]
    for opt in plan.options:
        cursor = "›" if selected == opt.index else " "
        mark = st(f" ★ recommended by {RECOMMENDER[plan.recommended_by]}", "green", "bold") if opt.recommended else ""
        label = f"{cursor} {opt.index + 1}. {opt.label}"
        label = st(label, "rev") if selected == opt.index else st(label, "bold" if opt.recommended else "")
        out.append(label + mark)
        out += [st(ln, "dim") for ln in _wrap(opt.reasoning, width - 2, "      ")]
    if plan.hatches:
        out.append("")
        for h in plan.hatches:
            out.append(f"  [{HATCH_KEYS[h.kind]}] {st(h.label, 'bold')}  " + st(h.hint, "dim"))
    return out


def render_clarification(plan: ClarificationPlan, st: Style, width: int) -> list[str]:
    out = header_line(plan, st)
    if plan.expires_at:
        out.append(st(f"Answer before {plan.expires_at}", "yellow"))
    out.append(st("The agent asks you a question" + ("s" if len(plan.questions) > 1 else ""), "bold"))
    for i, q in enumerate(plan.questions, 1):
        out += _wrap(q.question, width, "     ", f"  {i}. ")
    return out


def render_authorization(plan: AuthorizationPlan, st: Style, width: int) -> list[str]:
    out = header_line(plan, st)
    if plan.status == "BLOCKED":
        out.append(st(" BLOCKED ", "redbg") + st(f" authorization envelope ({plan.variant}) not shown", "red"))
    else:
        out.append(st(f"{plan.title}", "bold") + st(f"  ·  workflow {plan.workflow_id}", "dim"))
    for f in plan.fields:
        out += _wrap(f.value, width, "    ", f"  {f.label}: ")
    return out


def render_notice(plan: NoticePlan, st: Style, width: int) -> list[str]:
    out = header_line(plan, st)
    out.append(st(" NOTICE ", "yellowbg") + " " + st("not a decision", "yellow"))
    out += [st(ln, "yellow") for ln in _wrap(plan.diagnostic, width)]
    if plan.conventional is not None:
        out.append(st("What the agent sent:", "cyan"))
        out += _wrap(plan.conventional, width, "  ", "  ")
    return out


def render_plan(plan: Plan, *, width: int = 80, color: bool = False, selected: int | None = None,
                whole: bool = False) -> list[str]:
    """The lines a terminal shows for ``plan``; ``whole``: a gateway-made moment's arguments in full."""
    st = Style(color)
    match plan:
        case DecisionPlan():
            return render_decision(plan, st, width, selected, whole)
        case ClarificationPlan():
            return render_clarification(plan, st, width)
        case AuthorizationPlan():
            return render_authorization(plan, st, width)
        case NoticePlan():
            return render_notice(plan, st, width)
        case WithdrawPlan():
            return [st(f"Moment {plan.moment_id[:12]}… withdrawn ({plan.reason})", "dim")]
    return [repr(plan)]


def describe_standing(a: StandingApproval) -> str:
    """One standing approval in her words: what runs without asking, by whom, where, until when."""
    where = "in this session only" if a.kind == "session" else "in any session"
    return (f"{STANDING_KIND[a.kind]}: {a.tool or a.action} by agent {a.agent} on files directly in "
            f"\"{a.folder}\", {where}, until {a.expires_at}")


def render_standing(approvals: list[StandingApproval], selected: int, st: Style, width: int) -> list[str]:
    """The terminal's standing-approvals view: each one numbered, the chosen one marked for ``r``."""
    out = [st("Standing approvals", "cyan", "bold"),
           st("Calls these cover run without asking you; revoke one and the next such call asks again.", "dim"), ""]
    if not approvals:
        return [*out, st("You have no standing approvals.", "dim")]
    for i, a in enumerate(approvals):
        line = _wrap(describe_standing(a), width - 2, "      ", f"{'›' if i == selected else ' '} {i + 1}. ")
        out += [st(line[0], "rev") if i == selected else line[0], *line[1:]]
        out.append(st(f"      id {a.scope_id} · granted {a.granted_at}", "dim"))
    return out

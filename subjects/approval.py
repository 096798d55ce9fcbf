"""A yes/no approval as a spec 000 binding moment, and the principal's answer as a decision.

Agents ask "may I?" and expect yes or no; spec 000 asks for 2-4 options
(§6.6), exactly one recommended (§6.7) and both hatches open by default
(§6.8). One mapping for every agent: the plain client's ``Agent.approve``
(subjects/client.py) and the framework integrations (integrations/) build
their moments here and read the answers here (docs/integrations.md "How a
yes/no approval maps to spec 000"):

- the question has two options, ``Approve`` (index 0) and ``Reject`` (index 1),
  each with its one-line reasoning; the agent's lean is ``recommended_idx``;
- the hatches stay open: a free-text answer (answer-space: "yes, but ...") and
  a dialogue veto (question-space: "wrong question") are neither yes nor no.
  They come back as ``Decision(kind="free_text" | "dialogue")`` with the text,
  and ``approved`` is False: only option 0 is a consent (an expiry is never one,
  DESIGN §6). Each caller hands the text back to the agent its own way.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from subjects.wire import (
    BindingMoment,
    DialogueVeto,
    FreeTextAnswer,
    Hatches,
    MomentMeta,
    MomentOption,
    OptionChoice,
    Question,
    ResolutionOutcome,
)

APPROVE, REJECT = 0, 1
MAX_FINDING = 500  # a finding stays one terse line (spec 000 §6.2); the slot itself allows 2000


def stable_id(*parts: str) -> str:
    """A deterministic correlation id: the same parts give the same moment after a restart (dedup, spec 002)."""
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:40]


def _clip(text: str, limit: int = MAX_FINDING) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def argument_findings(arguments: Any) -> list[str]:
    """One finding per argument (``name = value`` as JSON), clipped to the slot's length."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return [_clip(f"arguments (not JSON): {arguments}")]
    if isinstance(arguments, dict):
        if not arguments:
            return ["the call takes no arguments"]
        return [_clip(f"{k} = {json.dumps(v, ensure_ascii=False, default=str)}") for k, v in list(arguments.items())[:16]]
    return [_clip(f"arguments = {json.dumps(arguments, ensure_ascii=False, default=str)}")]


def approval_moment(
    action: str,
    findings: list[str],
    *,
    synopsis: str | None = None,
    stem: str | None = None,
    recommend: Literal["approve", "reject"] = "approve",
    approve_reasoning: str = "The agent carries out the action as described in the findings.",
    reject_reasoning: str = "Nothing is done; the agent is told the action was rejected and goes on without it.",
    decision_class: str = "consent",
) -> BindingMoment:
    """The binding moment for "may the agent do ``action``?" (spec 000 §5-§6; 2 options, hatches open)."""
    if not action.strip():
        raise ValueError("approval_moment: action must name what the principal approves")
    return BindingMoment(
        synopsis=synopsis or _clip(f"I propose to {action}."),
        findings=findings[:16],
        recommendations=[_clip(f"Approve: {action}."), "Reject it, or answer in your own words to redirect the agent."],
        offer="Ask for detail on any finding.",
        question=Question(
            stem=stem or _clip(f"Should the agent {action}?"),
            options=[
                MomentOption(label="Approve", reasoning=approve_reasoning),
                MomentOption(label="Reject", reasoning=reject_reasoning),
            ],
            recommended_idx=APPROVE if recommend == "approve" else REJECT,
            hatches=Hatches(free_text=True, dialogue=True),
        ),
        meta=MomentMeta(decision_class=decision_class),
    )


@dataclass(frozen=True)
class Decision:
    """What the principal said to an approval moment, in a framework's yes/no terms."""

    kind: Literal["approve", "reject", "free_text", "dialogue", "expired"]
    text: str | None = None  # the free text, or the dialogue objection
    moment_id: str | None = None

    @property
    def approved(self) -> bool:
        return self.kind == "approve"

    def message(self) -> str:
        """The words to hand back to the agent when it was not approved."""
        if self.kind == "free_text":
            return f"The principal did not approve the call as proposed and answered: {self.text}"
        if self.kind == "dialogue":
            why = f": {self.text}" if self.text else "."
            return f"The principal rejected the question itself and asks to reconsider{why}"
        if self.kind == "expired":
            return "The principal did not answer before the request expired; treat it as rejected."
        return "The principal rejected this call."


def decision_of(outcome: ResolutionOutcome | None) -> Decision:
    """Map a resolution (None: the moment expired) to a Decision; option indexes past 1 read as reject."""
    if outcome is None:
        return Decision("expired")
    res = outcome.resolution
    if isinstance(res, OptionChoice):
        return Decision("approve" if res.index == APPROVE else "reject", moment_id=outcome.moment_id)
    if isinstance(res, FreeTextAnswer):
        return Decision("free_text", res.text, outcome.moment_id)
    if isinstance(res, DialogueVeto):
        return Decision("dialogue", res.objection, outcome.moment_id)
    raise ValueError(f"an approval moment cannot be resolved by {type(res).__name__}")

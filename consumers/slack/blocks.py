"""Render plans (consumers/surfaces/model.py) as Slack Block Kit messages and modals.

The render model already decided what may be shown (spec 000 §9): a
``DecisionPlan`` is a whole, well-formed moment; anything else is a notice, an
authorization item (BLOCKED when spec 001 says so) or a clarification. This
module only maps plan fields to blocks, under three rules of its own:

* Everything the agent wrote goes into ``plain_text`` objects (``emoji``
  off): no mrkdwn, links, mentions (``<!channel>``) or look-alike formatting
  from agent content. Our own labels (the recommended marker, the untrusted
  warning, the status of a closed moment) are ``mrkdwn`` in blocks of their
  own, so an agent cannot forge them by writing "★ Recommended" in a label.
* §9.1: all four briefing slots, the question, each option with its reasoning
  in the same section as its button, the recommended option marked by a block
  of ours beside it and its button styled like every other (not pre-selected,
  not ``primary``), one button per open hatch.
* §9.3: a moment Slack cannot carry whole (more than 50 blocks after
  splitting long text into 3000-character sections) becomes a notice that
  points to the app, never a cut-down decision.

Every message and modal is checked with slack-sdk's own Block Kit classes
(:func:`check_blocks`) before it is sent.
"""

from __future__ import annotations

import json
from typing import Any

from slack_sdk.models.blocks import Block
from slack_sdk.models.views import View

from consumers.surfaces.model import (
    AuthorizationPlan,
    ClarificationPlan,
    DecisionPlan,
    NoticePlan,
    Plan,
    WithdrawPlan,
)

MAX_BLOCKS = 50  # Slack: a message holds at most 50 blocks
SECTION_CHARS = 2900  # Slack: a section's text at most 3000 characters
MAX_MODAL_INPUT = 3000  # Slack: plain_text_input max_length at most 3000
ACTION_PREFIX = "pgw_"

Blocks = list[dict[str, Any]]


class InvalidBlocks(ValueError):
    """slack-sdk's Block Kit classes refuse these blocks."""


def check_blocks(blocks: Blocks) -> None:
    """Parse every block with slack-sdk's models; refuse a block it cannot parse, drops or limits."""
    if len(blocks) > MAX_BLOCKS:
        raise InvalidBlocks(f"{len(blocks)} blocks; a message holds at most {MAX_BLOCKS}")
    for b in blocks:
        try:
            parsed = Block.parse(b)
            again = parsed.to_dict() if parsed is not None else None  # to_dict() validates limits
        except Exception as e:
            raise InvalidBlocks(f"{b.get('type')!r} block refused: {e}") from e
        if again != b:
            raise InvalidBlocks(f"{b.get('type')!r} block does not survive slack-sdk's model: {b}")


def check_view(view: dict[str, Any]) -> None:
    try:
        again = View(**view).to_dict()
    except Exception as e:
        raise InvalidBlocks(f"view refused: {e}") from e
    if again != view:
        raise InvalidBlocks("view does not survive slack-sdk's model")
    check_blocks(view.get("blocks", []))


def plain(text: str) -> dict[str, Any]:
    return {"type": "plain_text", "text": text or " ", "emoji": False}


def mrkdwn(text: str) -> dict[str, Any]:
    return {"type": "mrkdwn", "text": text}


def escape(text: str) -> str:
    """Slack's three control characters, for the few values of ours put in mrkdwn."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def chunks(text: str, size: int = SECTION_CHARS) -> list[str]:
    """Split ``text`` into pieces Slack takes in one section, at line or word ends where possible."""
    out: list[str] = []
    while len(text) > size:
        cut = text.rfind("\n", 0, size)
        if cut < size // 2:
            cut = text.rfind(" ", 0, size)
        if cut < size // 2:
            cut = size
        out.append(text[:cut])
        text = text[cut:].lstrip("\n")
    out.append(text)
    return out


def sections(text: str, accessory: dict[str, Any] | None = None) -> Blocks:
    out: Blocks = []
    for i, piece in enumerate(chunks(text)):
        block: dict[str, Any] = {"type": "section", "text": plain(piece)}
        if i == 0 and accessory is not None:
            block["accessory"] = accessory
        out.append(block)
    return out


def button(text: str, action: str, value: dict[str, Any]) -> dict[str, Any]:
    # No "style": the recommended option's button looks like every other (spec 000 §9.1, §12.2).
    return {"type": "button", "text": plain(text), "action_id": ACTION_PREFIX + action,
            "value": json.dumps(value, separators=(",", ":"))}


def bullets(items: list[str]) -> str:
    return "\n".join(f"• {i}" for i in items) if items else "(none)"


def _untrusted(plan: Plan) -> Blocks:
    if not plan.untrusted:
        return []
    return [{"type": "context", "elements": [mrkdwn(
        ":warning: *Built from untrusted content* (spec 000 §12.5): read it critically.")]}]


def _header(text: str) -> dict[str, Any]:
    return {"type": "header", "text": plain(text[:150])}


def decision_blocks(plan: DecisionPlan, principal: str, *, live: bool = True) -> Blocks:
    """The whole moment; with ``live`` the option and hatch buttons, else none."""
    ref = {"p": principal, "m": plan.moment_id}
    gateway = plan.recommended_by == "gateway"
    head = f"Approval waits: agent {plan.agent} asks to act" if gateway else f"A decision waits: agent {plan.agent}"
    out: Blocks = [_header(head), *_untrusted(plan)]
    out += sections(f"Synopsis\n{plan.synopsis}")
    out += sections(f"Findings\n{bullets(plan.findings)}")
    at = len(out)  # where a gateway-made moment's arguments in full go (below)
    out += sections(f"Recommendations\n{bullets(plan.recommendations)}")
    out += sections(f"Offer\n{plan.offer}")
    out.append({"type": "divider"})
    out += sections(f"Question\n{plan.stem}")
    for o in plan.options:
        acc = button(f"Choose {o.index + 1}", f"option_{o.index}", {**ref, "k": "option", "i": o.index}) if live else None
        out += sections(f"{o.index + 1}. {o.label}\n{o.reasoning}", acc)
        if o.recommended:
            who = "the gateway's policy" if gateway else "the agent"
            out.append({"type": "context", "elements": [mrkdwn(
                f":star: *Recommended by {who}* (option {o.index + 1}; not chosen for you)")]})
    if live and plan.hatches:
        out.append({"type": "actions", "block_id": "pgw_hatches", "elements": [
            button(h.label, h.kind, {**ref, "k": h.kind})  # the words of every surface (docs/surfaces.md)
            for h in plan.hatches]})
    meta = f"moment `{plan.moment_id}`"
    if plan.expires_at:
        meta += f" · expires {escape(plan.expires_at)}"
    if plan.decision_class and not gateway:  # a gateway-made moment's class (idp.hem) is for the record
        meta += f" · class {escape(plan.decision_class)}"
    out.append({"type": "context", "elements": [mrkdwn(meta)]})
    if plan.attachments:
        # Never silently clipped: the arguments in full when the message holds them, else said so.
        whole: Blocks = []
        for a in plan.attachments:
            whole += sections(f"Argument {a.name} in full ({a.chars:,} characters)\n{a.text}")
        if len(out) + len(whole) > MAX_BLOCKS:
            chars = sum(a.chars for a in plan.attachments)
            whole = [{"type": "context", "elements": [mrkdwn(
                f":warning: *The arguments in full ({chars:,} characters) do not fit in a Slack message*: "
                "read them in the web app or `pgw surface` before you answer.")]}]
        out[at:at] = whole
    return out


def clarification_blocks(plan: ClarificationPlan, principal: str, *, live: bool = True) -> Blocks:
    out: Blocks = [_header(f"A question waits: agent {plan.agent}"), *_untrusted(plan)]
    for n, q in enumerate(plan.questions, 1):
        out += sections(f"{n}. {q.question}")
    if live:
        out.append({"type": "actions", "block_id": "pgw_answers", "elements": [
            button("Answer the questions", "answers", {"p": principal, "m": plan.moment_id, "k": "answers"})]})
    meta = f"moment `{plan.moment_id}`" + (f" · expires {escape(plan.expires_at)}" if plan.expires_at else "")
    out.append({"type": "context", "elements": [mrkdwn(meta)]})
    return out


def authorization_blocks(plan: AuthorizationPlan) -> Blocks:
    out: Blocks = [_header(f"{plan.title}: agent {plan.agent}"), *_untrusted(plan)]
    if plan.status == "BLOCKED":
        # spec 001 "Client Requirement": fail closed, the content is not shown.
        out.append({"type": "section", "text": mrkdwn(":no_entry: *BLOCKED*: this item is not shown (fail closed).")})
    for f in plan.fields:
        out += sections(f"{f.label}\n{f.value}")
    out.append({"type": "context", "elements": [mrkdwn(
        f"{escape(plan.variant)} · workflow `{escape(plan.workflow_id)}` · nothing to answer")]})
    return out


def notice_blocks(plan: NoticePlan, surface_url: str = "") -> Blocks:
    out: Blocks = [_header(f"Notice: agent {plan.agent}"), *_untrusted(plan)]
    out += sections(plan.diagnostic)
    if plan.conventional:
        out += sections(f"The agent's own text\n{plan.conventional}")
    tail = "Nothing to answer here."
    if surface_url:
        tail += f" Open the app: {escape(surface_url)}"
    out.append({"type": "context", "elements": [mrkdwn(tail)]})
    return out[:MAX_BLOCKS]


def too_long_notice(plan: DecisionPlan | ClarificationPlan, surface_url: str) -> NoticePlan:
    """spec 000 §9.3: what Slack cannot carry whole is a notice, never a cut-down decision."""
    what = "decision" if isinstance(plan, DecisionPlan) else "question"
    return NoticePlan(agent=plan.agent, created_at=plan.created_at, untrusted=plan.untrusted, item_id=plan.moment_id,
                      diagnostic=f"This {what} is too long for one Slack message to show whole; "
                                 "answer it in the app (or the terminal surface).",
                      conventional=None)


def render(plan: Plan, principal: str, *, surface_url: str = "") -> tuple[str, Blocks]:
    """(notification text, blocks) of a live item; the notification text carries no agent content."""
    match plan:
        case DecisionPlan():
            blocks = decision_blocks(plan, principal)
            if len(blocks) > MAX_BLOCKS:
                return render(too_long_notice(plan, surface_url), principal, surface_url=surface_url)
            return f"A decision from agent {plan.agent} waits", blocks
        case ClarificationPlan():
            blocks = clarification_blocks(plan, principal)
            if len(blocks) > MAX_BLOCKS or len(plan.questions) > 20:
                return render(too_long_notice(plan, surface_url), principal, surface_url=surface_url)
            return f"A question from agent {plan.agent} waits", blocks
        case AuthorizationPlan():
            return f"{plan.title} from agent {plan.agent}", authorization_blocks(plan)[:MAX_BLOCKS]
        case NoticePlan():
            return f"A notice from agent {plan.agent}", notice_blocks(plan, surface_url)
        case WithdrawPlan():
            return "Withdrawn", [{"type": "section", "text": mrkdwn("Withdrawn.")}]
    raise TypeError(type(plan).__name__)


def closed(plan: Plan, principal: str, status: str, detail: str = "") -> tuple[str, Blocks]:
    """The message once the moment is answered, expired or withdrawn: the status first, no buttons.

    ``status`` is ours (mrkdwn); ``detail``, the answer as given, is plain text.
    """
    head: Blocks = [{"type": "section", "text": mrkdwn(status)}, *(sections(detail) if detail else []),
                    {"type": "divider"}]
    match plan:
        case DecisionPlan():
            body = decision_blocks(plan, principal, live=False)
        case ClarificationPlan():
            body = clarification_blocks(plan, principal, live=False)
        case AuthorizationPlan():
            body = authorization_blocks(plan)
        case _:
            body = []
    blocks = head + body
    if len(blocks) > MAX_BLOCKS:
        blocks = [*head, body[0]] if body else head
    return status.replace("*", ""), blocks


def free_text_modal(principal: str, moment_id: str, stem: str) -> dict[str, Any]:
    return _modal("Answer in my own words", "pgw_free_text", {"p": principal, "m": moment_id, "k": "free_text"}, [
        *sections(f"Question\n{stem}"),
        {"type": "input", "block_id": "answer", "label": plain("Your answer"),
         "element": {"type": "plain_text_input", "action_id": "text", "multiline": True,
                     "max_length": MAX_MODAL_INPUT}},
    ])


def dialogue_modal(principal: str, moment_id: str, stem: str) -> dict[str, Any]:
    return _modal("Reject the question", "pgw_dialogue", {"p": principal, "m": moment_id, "k": "dialogue"}, [
        *sections(f"Question\n{stem}"),
        {"type": "input", "block_id": "objection", "optional": True, "label": plain("Why? (optional)"),
         "element": {"type": "plain_text_input", "action_id": "text", "multiline": True,
                     "max_length": MAX_MODAL_INPUT}},
    ])


def answers_modal(principal: str, plan: ClarificationPlan) -> dict[str, Any]:
    blocks: Blocks = []
    for n, q in enumerate(plan.questions, 1):
        blocks.append({"type": "input", "block_id": f"q{n - 1}", "label": plain(f"{n}. {q.question}"[:2000]),
                       "element": {"type": "plain_text_input", "action_id": "text", "multiline": True,
                                   "max_length": MAX_MODAL_INPUT}})
    return _modal("Answer the questions", "pgw_answers", {"p": principal, "m": plan.moment_id, "k": "answers"}, blocks)


def _modal(title: str, callback: str, meta: dict[str, Any], blocks: Blocks) -> dict[str, Any]:
    return {"type": "modal", "callback_id": callback, "title": plain(title[:24]), "submit": plain("Send"),
            "close": plain("Cancel"), "private_metadata": json.dumps(meta, separators=(",", ":")),
            "blocks": blocks}

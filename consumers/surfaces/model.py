"""The render model every surface shares: a surface item becomes a render plan.

A *plan* is what a surface may show, already checked against the renderer
contract of spec 000 §9, so a surface (terminal, browser, someone else's)
only maps plan fields to native widgets and cannot drop an invariant by
accident:

* ``decision``: a well-formed binding moment. All four briefing slots
  (§9.1 first bullet), every option with its reasoning (§9.1 fourth bullet),
  ``recommended`` on exactly one option (§9.1 second bullet), and one hatch
  entry per hatch whose slot-8 boolean is true (§9.1 third bullet, §12.3).
* ``clarification``: spec 002 questions for the principal.
* ``authorization``: an RFC-0010 envelope rendered per variant (spec 001
  "Client Requirement"): an unknown ``kind``, a refusal with a code outside
  spec 001's four, or an authoritative kind without its provenance, is
  ``BLOCKED`` (fail closed) and its content is not shown.
* ``notice``: the fallback form (spec 000 §9.3, §12.5): the conventional
  payload as text plus a diagnostic. Anything that cannot be planned as a
  whole (undecodable, malformed moment, recommended_idx out of range) lands
  here, never in a partial decision.
* ``withdraw``: remove the moment (resolved elsewhere, expired, superseded).

:func:`plan_item` never raises. The browser app (``consumers/web/src/plan.js``)
implements the same function; the browser tests compare both on one corpus.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

from subjects.util import one_line
from subjects.wire import (
    AuthorizationItem,
    BindingMomentItem,
    ClarificationItem,
    NoticeItem,
    SurfaceItem,
    WithdrawnItem,
    surface_item_decoder,
)

# How much of an opaque JSON value (conventional payload, params, oracle
# values) a plan carries as text; a surface is not a dump viewer.
MAX_VALUE_CHARS = 4000

HATCH_TEXT = {
    # spec 000 §6.8 / §7.2: the answer-space hatch accepts the question and
    # revises the answer; the question-space hatch rejects the framing.
    "free_text": ("Answer in my own words", "Accept the question, but answer it yourself."),
    "dialogue": ("Reject the question", "The question itself is wrong or premature; reopen deliberation."),
}

AUTHORITATIVE_KINDS = ("measurement", "classification", "action")
REFUSAL_CODES = ("BLOCKED", "UNRESOLVABLE", "POLICY_VIOLATION", "EMERGENCY_ESCALATION")  # spec 001 RefusalReason


class OptionView(Struct, frozen=True):
    index: int
    label: str
    reasoning: str
    recommended: bool


class HatchView(Struct, frozen=True):
    kind: Literal["free_text", "dialogue"]
    label: str
    hint: str


class AttachmentView(Struct, frozen=True):
    """One argument of a gated action, whole, as the gateway's card attaches it (shown on request)."""

    name: str
    text: str
    chars: int


class QuestionView(Struct, frozen=True):
    id: str
    question: str


class FieldView(Struct, frozen=True):
    label: str
    value: str


class PlanBase(Struct, tag_field="plan", kw_only=True, frozen=True):
    agent: str
    created_at: str
    untrusted: bool = False


class DecisionPlan(PlanBase, tag="decision"):
    moment_id: str
    expires_at: str | None
    hem: bool
    synopsis: str
    findings: list[str]
    recommendations: list[str]
    offer: str
    stem: str
    options: list[OptionView]
    recommended_idx: int
    hatches: list[HatchView]
    decision_class: str | None = None
    calibration_note: str | None = None
    # Who recommends the recommended option: the agent that wrote the moment, or, on a moment the
    # gateway made itself (``hem``: an approval before a gated action, a gap), the gateway's policy.
    recommended_by: Literal["agent", "gateway"] = "agent"
    # A gateway-made moment's arguments, whole (its conventional payload, gateway/kernel/hem.py
    # ``attachment``): a surface shows them on request, so a long value is never silently clipped.
    attachments: list[AttachmentView] = []


class ClarificationPlan(PlanBase, tag="clarification"):
    moment_id: str
    expires_at: str | None
    context_type: str | None
    questions: list[QuestionView]


class AuthorizationPlan(PlanBase, tag="authorization"):
    item_id: str
    workflow_id: str
    variant: str
    status: Literal["shown", "BLOCKED"]
    title: str
    fields: list[FieldView]


class NoticePlan(PlanBase, tag="notice"):
    item_id: str
    diagnostic: str
    conventional: str | None


class WithdrawPlan(PlanBase, tag="withdraw"):
    moment_id: str
    reason: str


Plan = DecisionPlan | ClarificationPlan | AuthorizationPlan | NoticePlan | WithdrawPlan

_json = msgspec.json.Encoder(order="sorted")
plan_encoder = msgspec.json.Encoder()


def value_text(value: Any) -> str:
    """An opaque JSON value as readable text (strings as-is), bounded in size."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = _json.encode(value).decode()
        except (TypeError, msgspec.EncodeError):
            text = repr(value)
    if len(text) > MAX_VALUE_CHARS:
        text = text[:MAX_VALUE_CHARS] + "… (truncated)"
    return text


def plan_item(data: bytes | str | dict[str, Any] | SurfaceItem) -> Plan:
    """Turn one surface item (raw JSON or decoded) into a render plan; never raises."""
    raw: dict[str, Any] | None = None
    try:
        if isinstance(data, BindingMomentItem | ClarificationItem | AuthorizationItem | NoticeItem | WithdrawnItem):
            item = data
        else:
            if isinstance(data, dict):
                raw = data
                data = msgspec.json.encode(data)
            elif isinstance(data, str):
                data = data.encode()
            if raw is None:
                try:
                    decoded = msgspec.json.decode(data)
                    raw = decoded if isinstance(decoded, dict) else None
                except msgspec.DecodeError:
                    raw = None
            item = surface_item_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, UnicodeError) as e:
        return _undecodable(raw, data, str(e))
    try:
        return _plan(item)
    except Exception as e:  # noqa: BLE001 - a surface must fall back, never crash (spec 000 §9.3)
        return _undecodable(raw, data, f"{type(e).__name__}: {e}")


def _undecodable(raw: dict[str, Any] | None, data: Any, why: str) -> NoticePlan:
    raw = raw or {}

    def s(key: str) -> str:
        v = raw.get(key)
        return v if isinstance(v, str) else ""

    kind = s("item") or "unknown"
    ident = s("moment_id") or s("item_id")
    # The moment's content may be the malformed part: show the agent's
    # conventional payload if there is one, never a repaired decision.
    conventional = raw.get("conventional")
    if conventional is None and not raw and isinstance(data, bytes | str):
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
        conventional = text
    return NoticePlan(
        agent=s("agent") or "unknown agent",
        created_at=s("created_at"),
        untrusted=raw.get("untrusted") is True,
        item_id=ident,
        diagnostic=f"This {kind} item could not be shown as a decision and was discarded ({why}).",
        conventional=None if conventional is None else value_text(conventional),
    )


def _plan(item: SurfaceItem) -> Plan:
    base = {"agent": item.agent, "created_at": item.created_at, "untrusted": item.untrusted}
    match item:
        case BindingMomentItem():
            return _decision(item, base)
        case ClarificationItem():
            return ClarificationPlan(
                **base,
                moment_id=item.moment_id,
                expires_at=item.expires_at,
                context_type=item.context_type,
                questions=[QuestionView(q.id, q.question) for q in item.questions],
            )
        case AuthorizationItem():
            return _authorization(item, base)
        case NoticeItem():
            return NoticePlan(
                **base,
                item_id=item.item_id,
                diagnostic=item.diagnostic,
                conventional=None if item.conventional is None else value_text(item.conventional),
            )
        case WithdrawnItem():
            return WithdrawPlan(**base, moment_id=item.moment_id, reason=item.reason)
    raise TypeError(f"unhandled surface item {type(item).__name__}")


def _decision(item: BindingMomentItem, base: dict[str, Any]) -> Plan:
    bm = item.binding_moment
    q = bm.question
    # spec 000 §5: out-of-range recommended_idx or fewer than two options is
    # malformed; §12.5: discard it rather than render a partial decision.
    problem = None
    if not 2 <= len(q.options) <= 4:
        problem = f"{len(q.options)} options; a binding moment has 2 to 4"
    elif not 0 <= q.recommended_idx < len(q.options):
        problem = f"recommended_idx {q.recommended_idx} is not an index of its {len(q.options)} options"
    elif not bm.synopsis.strip() or not bm.offer.strip() or not q.stem.strip():
        problem = "an empty briefing or question slot"
    if problem:
        return NoticePlan(
            **base,
            item_id=item.moment_id,
            diagnostic=f"Malformed binding moment discarded: {problem} (spec 000 §5, §12.5).",
            conventional=None,
        )
    hatches = [
        HatchView(kind, *HATCH_TEXT[kind])  # type: ignore[arg-type]
        for kind, open_ in (("free_text", q.hatches.free_text), ("dialogue", q.hatches.dialogue))
        if open_
    ]
    return DecisionPlan(
        **base,
        moment_id=item.moment_id,
        expires_at=item.expires_at,
        hem=item.hem,
        synopsis=bm.synopsis,
        findings=list(bm.findings),
        recommendations=list(bm.recommendations),
        offer=bm.offer,
        stem=one_line(q.stem),  # the stem and each option's reasoning too: a line break drew a fake option row
        options=[
            # One line each, whatever the moment holds: a CR in a label drew another option's text over it on
            # a terminal (the grammar refuses such a label; a moment stored before it did not), and one in the
            # stem or a reasoning drew a row that looked like an option.
            OptionView(i, one_line(o.label), one_line(o.reasoning), i == q.recommended_idx)
            for i, o in enumerate(q.options)
        ],
        recommended_idx=q.recommended_idx,
        hatches=hatches,
        decision_class=bm.meta.decision_class if bm.meta else None,
        calibration_note=bm.meta.calibration_note if bm.meta else None,
        recommended_by="gateway" if item.hem else "agent",
        attachments=_attachments(item.conventional) if item.hem else [],
    )


def _attachments(conventional: Any) -> list[AttachmentView]:
    """The arguments a gateway-made moment attaches whole (``{"arguments": [{"name", "text"}]}``); none if malformed."""
    args = conventional.get("arguments") if isinstance(conventional, dict) else None
    if not isinstance(args, list):
        return []
    out = [AttachmentView(a["name"], a["text"], len(a["text"])) for a in args
           if isinstance(a, dict) and isinstance(a.get("name"), str) and isinstance(a.get("text"), str)]
    return out if len(out) == len(args) else []


def _blocked(item: AuthorizationItem, base: dict[str, Any], variant: str, why: str) -> AuthorizationPlan:
    return AuthorizationPlan(
        **base,
        item_id=item.item_id,
        workflow_id=item.workflow_id,
        variant=variant,
        status="BLOCKED",
        title="BLOCKED",
        fields=[FieldView("Why", why)],
    )


def _authorization(item: AuthorizationItem, base: dict[str, Any]) -> AuthorizationPlan:
    env = item.envelope
    kind = env.get("kind")
    variant = kind if isinstance(kind, str) else "(none)"
    fields: list[FieldView] = []

    def shown(title: str) -> AuthorizationPlan:
        return AuthorizationPlan(
            **base, item_id=item.item_id, workflow_id=item.workflow_id, variant=variant,
            status="shown", title=title, fields=fields,
        )

    if kind in AUTHORITATIVE_KINDS:
        # spec 001: authoritative kinds carry provenance with at least one
        # oracle record; shown only as the explicit variant, else fail closed.
        prov = env.get("provenance")
        records = prov.get("oracle_records") if isinstance(prov, dict) else None
        if not isinstance(records, list) or not records:
            return _blocked(item, base, variant, f"{kind} without oracle provenance (spec 001)")
        if kind == "measurement":
            if not isinstance(env.get("value"), int | float) or isinstance(env.get("value"), bool):
                return _blocked(item, base, variant, "measurement without a numeric value")
            fields.append(FieldView("Value", value_text(env["value"])))
            title = "Measurement"
        elif kind == "classification":
            if not isinstance(env.get("label"), str):
                return _blocked(item, base, variant, "classification without a label")
            fields.append(FieldView("Label", env["label"]))
            title = "Classification"
        else:
            if not isinstance(env.get("action"), str):
                return _blocked(item, base, variant, "action without an action name")
            fields.append(FieldView("Action", env["action"]))
            if env.get("params") is not None:
                fields.append(FieldView("Parameters", value_text(env["params"])))
            title = "Action"
        fields.append(FieldView("Oracle records", str(len(records))))
        if isinstance(prov.get("generated_at"), str):
            fields.append(FieldView("Generated at", prov["generated_at"]))
        if isinstance(prov.get("envelope_id"), str):
            fields.append(FieldView("Envelope", prov["envelope_id"]))
        return shown(title)
    if kind == "narrative":
        if not isinstance(env.get("text"), str):
            return _blocked(item, base, variant, "narrative without text")
        fields.append(FieldView("Text", env["text"]))
        policy = env.get("policy")
        if isinstance(policy, dict) and isinstance(policy.get("grammar_mode"), str):
            fields.append(FieldView("Grammar mode", policy["grammar_mode"]))
        return shown("Narrative (not authoritative)")
    if kind == "refusal":
        reason = env.get("reason")
        if not isinstance(reason, dict) or not isinstance(reason.get("code"), str):
            return _blocked(item, base, variant, "refusal without a reason code")
        if reason["code"] not in REFUSAL_CODES:
            # spec 001 RefusalReason: four codes; anything else fails closed like an unknown kind.
            return _blocked(item, base, variant, "refusal with an unknown code: blocked (fail closed, spec 001)")
        fields.append(FieldView("Code", reason["code"]))
        if isinstance(reason.get("user_message"), str):
            fields.append(FieldView("Message", reason["user_message"]))
        if isinstance(reason.get("recovery_hint"), str):
            fields.append(FieldView("What you can do", reason["recovery_hint"]))
        if isinstance(reason.get("audit_id"), str):
            fields.append(FieldView("Reference", reason["audit_id"]))
        return shown("Refused")
    if kind == "dispute_summary":
        sources = env.get("sources")
        if not isinstance(sources, list):
            return _blocked(item, base, variant, "dispute summary without sources")
        for src in sources:
            if not isinstance(src, dict):
                continue
            oracles = src.get("oracles") if isinstance(src.get("oracles"), list) else []
            parts = [
                f"{o.get('oracle_id', '?')} ({o.get('tier', '?')}): {value_text(o.get('value'))}"
                for o in oracles
                if isinstance(o, dict)
            ]
            note = " — escalation required" if src.get("escalation_required") is True else ""
            fields.append(FieldView(f"Axis {value_text(src.get('axis', '?'))}", "; ".join(parts) + note))
        return shown("Oracles disagree")
    # spec 001 "Clients MUST treat unknown kind values as BLOCKED (fail closed)".
    return _blocked(item, base, variant, f"unknown authorization kind {variant!r}: blocked (fail closed, spec 001)")


def plan_to_builtins(plan: Plan) -> dict[str, Any]:
    """The plan as plain JSON data (what ``pgw surface --json`` prints)."""
    return msgspec.to_builtins(plan)


__all__ = [
    "AttachmentView",
    "AuthorizationPlan",
    "ClarificationPlan",
    "DecisionPlan",
    "FieldView",
    "HatchView",
    "NoticePlan",
    "OptionView",
    "Plan",
    "QuestionView",
    "WithdrawPlan",
    "plan_item",
    "plan_to_builtins",
    "value_text",
]

"""Every message of the bus contract (DESIGN §2-§6) as msgspec Structs.

The same Structs validate the wire and generate the JSON Schemas that
``pgw schema`` prints, so the document and the validator cannot drift.
Tagged unions use the spec's own discriminator where it has one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from subjects.constraints import (
    MAX_LIST_ITEMS,
    MAX_OPTIONS,
    MIN_OPTIONS,
    AgentToken,
    Code,
    CorrelationId,
    EnvelopeId,
    EnvelopeTimestamp,
    FreeText,
    HexId,
    KindName,
    NonNegInt,
    OptionLabel,
    OptionReasoning,
    PrincipalToken,
    SlotText,
    Timestamp,
)

# ---------------------------------------------------------------------------
# Refusals (STYLE.md: refusals on the wire are Structs, never exception text)
# ---------------------------------------------------------------------------


class Detail(Struct, omit_defaults=True, frozen=True):
    """One actionable validation finding: where, which rule, what is wrong."""

    message: str
    path: str | None = None
    rule: str | None = None


class Refusal(Struct, omit_defaults=True, frozen=True):
    """A refusal code (spec 002 / 000 / 001 / 003 vocabulary) with its reason."""

    code: Code
    reason: str
    details: list[Detail] = field(default_factory=list)


# ---------------------------------------------------------------------------
# OpenWOP AI Envelope (spec 002 "AIEnvelope wire shape")
# ---------------------------------------------------------------------------

ContentTrust = Literal["trusted", "untrusted"]
Source = Literal["ai-generation", "user", "system"]


class RenderingHint(Struct, omit_defaults=True):
    """spec 002 "Rendering hints" (RFC 0055): advisory only."""

    display: str | None = None
    mimeType: str | None = None
    lang: str | None = None
    alt: str | None = None
    title: str | None = None


class EnvelopeMeta(Struct, omit_defaults=True):
    """spec 002 EnvelopeMeta. Open: vendor keys live under ``meta.<vendor>``.

    ``source`` is optional on the wire only for the spec 002 "Migration" rule
    (a missing source is synthesized as ``ai-generation`` with a warning).
    """

    ts: EnvelopeTimestamp
    source: Source | None = None
    contentTrust: ContentTrust | None = None
    traceparent: Annotated[str, Meta(max_length=128)] | None = None
    label: Annotated[str, Meta(max_length=256)] | None = None
    rendering: RenderingHint | None = None
    pgw: dict[str, Any] | None = None


class PartialInfo(Struct):
    """spec 002 PartialInfo (in-flight)."""

    isPartial: bool
    index: NonNegInt
    total: Annotated[int, Meta(ge=-1)]


class AIEnvelope(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """spec 002 AIEnvelope. The top level is closed (additionalProperties: false).

    ``envelopeId`` is assigned by the engine if absent; ``correlationId`` is
    synthesized with a warning if absent (spec 002 "Migration" 3); ``meta``
    absent is synthesized with a warning (spec 002 "Migration" 2).
    """

    type: KindName
    payload: Any
    meta: EnvelopeMeta | None = None
    envelopeId: EnvelopeId | None = None
    correlationId: CorrelationId | None = None
    schemaVersion: NonNegInt | None = None
    nodeId: Annotated[str, Meta(max_length=128)] | None = None
    partial: PartialInfo | None = None


# ---------------------------------------------------------------------------
# The binding moment (spec 000 §5, slot grammar §6)
# ---------------------------------------------------------------------------


class MomentOption(Struct, forbid_unknown_fields=True):
    """spec 000 §6.6: each option has a REQUIRED label and reasoning."""

    label: OptionLabel
    reasoning: OptionReasoning


class Hatches(Struct, forbid_unknown_fields=True):
    """spec 000 §6.8: two REQUIRED booleans, answer-space and question-space."""

    free_text: bool
    dialogue: bool


class Question(Struct, forbid_unknown_fields=True):
    """spec 000 §6.5-§6.8: stem, 2-4 options, one recommended option, hatches."""

    stem: SlotText
    options: Annotated[list[MomentOption], Meta(min_length=MIN_OPTIONS, max_length=MAX_OPTIONS)]
    recommended_idx: NonNegInt
    hatches: Hatches


class MomentMeta(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """spec 000 §6.9: both members individually OPTIONAL."""

    decision_class: Annotated[str, Meta(max_length=128)] | None = None
    calibration_note: Annotated[str, Meta(max_length=1000)] | None = None


class BindingMoment(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """spec 000 §5: the eight-slot object, "exactly the members specified"."""

    synopsis: SlotText
    findings: Annotated[list[SlotText], Meta(max_length=MAX_LIST_ITEMS)]
    recommendations: Annotated[list[SlotText], Meta(max_length=MAX_LIST_ITEMS)]
    offer: SlotText
    question: Question
    meta: MomentMeta | None = None


class BindingMomentPayload(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Payload of ``vendor.pgw.binding_moment`` (DESIGN §3.1)."""

    principal: Annotated[str, Meta(min_length=1, max_length=65)]
    binding_moment: BindingMoment
    conventional: Any = None
    expires_in_s: Annotated[int, Meta(ge=1, le=30 * 86400)] | None = None
    reasoning: Annotated[str, Meta(max_length=8000)] | None = None


# ---------------------------------------------------------------------------
# spec 002 universal kinds. Closed (forbid_unknown_fields), as the official
# schemas/envelopes/*.schema.json say (additionalProperties: false): an unknown
# member is envelope_invalid, never silently dropped.
# ---------------------------------------------------------------------------


class ClarificationQuestion(Struct, forbid_unknown_fields=True, omit_defaults=True):
    id: Annotated[str, Meta(min_length=1, max_length=128)]
    question: SlotText
    schema: dict[str, Any] | None = None
    # The official schema's open-shape bag (spec 002 "Redaction": walked like every other leaf).
    context: dict[str, Any] | None = None


class ClarificationRequestPayload(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """spec 002 ``clarification.request`` payload (open-shape children allowed)."""

    questions: Annotated[list[ClarificationQuestion], Meta(min_length=1, max_length=MAX_LIST_ITEMS)]
    contextType: Annotated[str, Meta(max_length=128)] | None = None
    reasoning: str | None = None


class SchemaRequestPayload(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """spec 002 ``schema.request`` payload."""

    envelopeType: KindName
    reason: Annotated[str, Meta(max_length=1024)] | None = None  # the official schema's maxLength
    reasoning: str | None = None


class SchemaResponsePayload(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """spec 002 ``schema.response`` payload."""

    envelopeType: KindName
    ack: Literal[True]


class ErrorEnvelopePayload(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """spec 002 ``error`` payload: the LLM's own error report (a successful turn)."""

    code: Code
    message: Annotated[str, Meta(min_length=1, max_length=2000)]  # official: minLength 1
    details: dict[str, Any] | None = None
    reasoning: str | None = None


class AuthorizationPayload(Struct, omit_defaults=True):
    """Payload of ``vendor.pgw.authorization`` (DESIGN §3.1): an RFC-0010 envelope."""

    workflow_id: Annotated[str, Meta(min_length=1, max_length=128)]
    envelope: dict[str, Any]
    principal: Annotated[str, Meta(min_length=1, max_length=65)] | None = None


# ---------------------------------------------------------------------------
# Surface items on principal.{principal}.surface (DESIGN §4.1), tag "item"
# ---------------------------------------------------------------------------


class SurfaceItemBase(Struct, tag_field="item", omit_defaults=True, kw_only=True):
    agent: AgentToken
    principal: PrincipalToken
    created_at: Timestamp
    untrusted: bool = False
    traceparent: str | None = None
    # spec 002 "Run event log integration": the events an envelope causes carry its nodeId
    # (optional: absent when the envelope named none, so the wire stays compatible).
    node_id: Annotated[str, Meta(max_length=128)] | None = None


class BindingMomentItem(SurfaceItemBase, tag="binding_moment"):
    """A well-formed binding moment for the principal to resolve."""

    moment_id: HexId
    envelope_id: EnvelopeId
    correlation_id: CorrelationId
    binding_moment: BindingMoment
    expires_at: Timestamp | None = None
    hem: bool = False
    # spec 000 §8.1/§9.3: the envelope's conventional payload, so a surface that cannot render the
    # moment falls back by itself (absent when the agent sent none).
    conventional: Any = None


class ClarificationItem(SurfaceItemBase, tag="clarification"):
    """A spec 002 clarification.request lifted to a question for the principal."""

    moment_id: HexId
    envelope_id: EnvelopeId
    correlation_id: CorrelationId
    questions: list[ClarificationQuestion]
    context_type: str | None = None
    expires_at: Timestamp | None = None


class AuthorizationItem(SurfaceItemBase, tag="authorization"):
    """An accepted RFC-0010 authorization envelope (spec 001), rendered per variant."""

    item_id: HexId
    envelope_id: EnvelopeId
    workflow_id: str
    envelope: dict[str, Any]


class NoticeItem(SurfaceItemBase, tag="notice"):
    """Fallback form (spec 000 §9.3, §12.5): conventional payload plus diagnostic."""

    item_id: HexId
    envelope_id: str
    diagnostic: str
    conventional: Any = None


class WithdrawnItem(SurfaceItemBase, tag="withdrawn"):
    """A moment no longer awaiting an answer (resolved elsewhere, expired, superseded)."""

    moment_id: HexId
    reason: Literal["resolved", "expired", "superseded"]


SurfaceItem = BindingMomentItem | ClarificationItem | AuthorizationItem | NoticeItem | WithdrawnItem


# ---------------------------------------------------------------------------
# Resolutions on principal.{principal}.resolve (DESIGN §4.2, spec 000 §7.3)
# ---------------------------------------------------------------------------


class OptionChoice(Struct, tag_field="kind", tag="option", forbid_unknown_fields=True):
    """The principal selected option ``index`` (a vote)."""

    index: NonNegInt


class FreeTextAnswer(Struct, tag_field="kind", tag="free_text", forbid_unknown_fields=True):
    """Answer-space hatch: accepts the question, revises the answer."""

    text: FreeText


class DialogueVeto(Struct, tag_field="kind", tag="dialogue", forbid_unknown_fields=True, omit_defaults=True):
    """Question-space hatch: rejects the framing and reopens deliberation."""

    objection: FreeText | None = None


class ClarificationAnswers(Struct, tag_field="kind", tag="answers", forbid_unknown_fields=True):
    """Answers to a clarification item, keyed by question id."""

    answers: Annotated[dict[str, FreeText], Meta(min_length=1, max_length=MAX_LIST_ITEMS)]


Resolution = OptionChoice | FreeTextAnswer | DialogueVeto | ClarificationAnswers


class ResolveRequest(Struct, forbid_unknown_fields=True):
    """Body a surface sends on ``principal.{principal}.resolve``."""

    moment_id: HexId
    resolution: Resolution


class ResolveReply(Struct, omit_defaults=True):
    """The gateway's reply to a resolve request: accepted, or why refused."""

    status: Literal["accepted", "refused"]
    moment_id: str | None = None
    code: str | None = None
    reason: str | None = None
    # Accepted: the answer as the gateway recorded it, after SR-1 redaction (what the agent gets);
    # a surface that echoes the answer echoes this, never the words as typed (docs/surfaces.md).
    resolution: Resolution | None = None


class PendingReply(Struct, omit_defaults=True):
    """Reply on ``principal.{principal}.pending``: items still awaiting the principal.

    ``more``: there are more than one reply can carry (the server's max_payload); ``items`` then holds each
    agent's oldest in turn, so no agent's moments keep another's out, and the rest follow as she answers."""

    items: list[SurfaceItem]
    more: bool = False


# ---------------------------------------------------------------------------
# Outcomes on agent.{agent}.outcome (DESIGN §4.3), tag "outcome"
# ---------------------------------------------------------------------------


class OutcomeBase(Struct, tag_field="outcome", omit_defaults=True, kw_only=True):
    agent: AgentToken
    ts: Timestamp
    untrusted: bool = False
    traceparent: str | None = None
    # spec 002 "Run event log integration": the events an envelope causes carry its nodeId
    # (optional: absent when the envelope named none, so the wire stays compatible).
    node_id: Annotated[str, Meta(max_length=128)] | None = None


class EnvelopeOutcome(OutcomeBase, tag="envelope_outcome"):
    """spec 002 EnvelopeOutcome: accepted / gated / invalid / breached."""

    status: Literal["accepted", "gated", "invalid", "breached"]
    envelope_id: str | None = None
    correlation_id: str | None = None
    type: str | None = None
    code: str | None = None
    reason: str | None = None
    details: list[Detail] = field(default_factory=list)
    warnings: list[Detail] = field(default_factory=list)
    cap_kind: Literal["envelopes", "schema", "clarification"] | None = None
    refused_type: str | None = None
    accepted_types: list[str] | None = None
    moment_id: str | None = None
    recorded_event_ids: list[str] = field(default_factory=list)
    replayed: bool = False
    # On a replay: the envelopeId whose outcome this is (spec 002 "returns the cached outcome";
    # ``envelope_id`` names the re-emission the agent waits on).
    replay_of: str | None = None


class ResolutionOutcome(OutcomeBase, tag="resolution"):
    """The principal's answer, the three cases of spec 000 §7.3 kept distinct."""

    moment_id: HexId
    principal: PrincipalToken
    envelope_id: str
    correlation_id: str
    resolution: Resolution
    resolved_at: Timestamp


class MomentExpired(OutcomeBase, tag="moment_expired"):
    """No answer before expiry: a refusal, never a consent (DESIGN §6)."""

    moment_id: HexId
    principal: PrincipalToken
    envelope_id: str
    correlation_id: str


class HemDecision(OutcomeBase, tag="hem_decision"):
    """The principal's answer to a human-escalation moment (spec 003 HEM).

    ``void``: she approved a step under a mandate that no longer stood when she answered (revoked, expired, or
    ended by a human on the same object: ``MANDATE_REVOKED``, ``MANDATE_EXPIRED``, ``SESSION_TERMINATED``), so
    her approval permits nothing; ``decision`` is then ``deny`` (what the agent may do), the event log's
    ``HEM_RESOLVED`` records ``approve`` with the same ``void`` (what she said). docs/kernel.md."""

    moment_id: HexId
    principal: PrincipalToken
    idp_id: str
    session_id: str
    decision: Literal["approve", "deny", "free_text", "dialogue", "expired"]
    text: str | None = None
    void: Literal["MANDATE_REVOKED", "MANDATE_EXPIRED", "SESSION_TERMINATED"] | None = None


class SchemaOutcome(OutcomeBase, tag="schema"):
    """Answer to a ``schema.request``: the kind's JSON Schema (spec 002)."""

    envelope_id: str
    correlation_id: str
    envelope_type: str
    schema_version: int
    schema: dict[str, Any]
    replayed: bool = False


class ActionResult(OutcomeBase, tag="action_result"):
    """The result of a gated action that did not come back in the ``act`` reply (subjects/gate.py):
    dispatched after a HEM approval, a late executor answer, or ``not_run`` (the principal
    rejected it, or the moment expired). ``response_digest`` is the JSON-DIGEST of the
    ``response`` the kernel received (spec 004 §5.2)."""

    idp_id: str
    status: Literal["confirmed", "failed", "dispatched_unconfirmed", "not_run"]
    response: Any = None
    response_digest: str | None = None
    reason: str | None = None
    moment_id: str | None = None
    verdict_id: str | None = None


Outcome = EnvelopeOutcome | ResolutionOutcome | MomentExpired | HemDecision | SchemaOutcome | ActionResult


# ---------------------------------------------------------------------------
# Verdicts on verdict.{verdict_class} (DESIGN §6)
# ---------------------------------------------------------------------------

VerdictClass = Literal[
    "blocked",
    "denied",
    "hitl_dispatched",
    "resolved",
    "expired",
    "executed",
    "errored",
    "engine_failure",
    "timeout",  # spec 004 §5.4.1: a kernel PERMIT without its report in time, or a moment unanswered
    # ("expired" stays decodable for verdicts already stored; the gateway no longer publishes it)
]


class ReportedEffect(Struct, omit_defaults=True):
    """An effect as an agent reported it (DESIGN §5.4); the gateway did not observe it."""

    type: str
    status: str
    request: Any = None
    response: Any = None
    external_ref: str | None = None
    irreversibility_class: str | None = None


class Verdict(Struct, omit_defaults=True, kw_only=True):
    """A terminal decision of the gateway; the signer turns each into one capsule.

    ``human_disposed`` may only be true when ``approver`` is ``human``
    (DESIGN §6 "never claim more than was observed"); the constructor refuses
    anything else.
    """

    verdict_id: HexId
    verdict_class: VerdictClass
    decision: Literal["accept", "reject", "needs_input"]
    approver: Literal["policy", "human"]
    human_disposed: bool
    ts: Timestamp
    agent: AgentToken | None
    action_type: str
    action_id: str
    principal: PrincipalToken | None = None
    envelope_id: str | None = None
    correlation_id: str | None = None
    moment_id: str | None = None
    idp_id: str | None = None
    reason: Refusal | None = None
    supersedes: HexId | None = None
    untrusted: bool = False
    traceparent: str | None = None
    node_id: Annotated[str, Meta(max_length=128)] | None = None  # spec 002: the envelope's nodeId
    resolution_kind: Literal["option", "free_text", "dialogue", "answers"] | None = None
    option_index: int | None = None
    text_digest: str | None = None
    effect: ReportedEffect | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.human_disposed and self.approver != "human":
            raise ValueError("human_disposed requires approver 'human'")
        if self.verdict_class == "resolved" and self.approver != "human":
            raise ValueError("a resolved verdict is disposed by a human")


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

surface_item_decoder = msgspec.json.Decoder(SurfaceItem)
outcome_decoder = msgspec.json.Decoder(Outcome)
resolve_request_decoder = msgspec.json.Decoder(ResolveRequest)
resolve_reply_decoder = msgspec.json.Decoder(ResolveReply)
pending_reply_decoder = msgspec.json.Decoder(PendingReply)
verdict_decoder = msgspec.json.Decoder(Verdict)
encoder = msgspec.json.Encoder()

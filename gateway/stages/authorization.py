"""``vendor.pgw.authorization``: RFC-0010 authorization envelopes (spec 001, DESIGN §3.4).

Order of checks, each a refusal to the agent (status ``gated``, a ``denied``
verdict) with a code the agent can act on:

1. ``unknown_workflow``: the ``workflow_id`` is not declared in
   ``[pipeline.workflows]`` (spec 001 "Workflow-Level Authoritative Intent":
   every workflow MUST declare its intent; undeclared = no authority);
2. ``unknown_authorization_kind``: the variant is none of the six (spec 001
   "Client Requirement": unknown kinds fail closed, rendered BLOCKED);
3. ``envelope_invalid``: the variant does not match its normative minimum schema;
4. ``authority_not_permitted``: measurement / classification / action from a
   ``non_authoritative`` (or ``NON_AUTHORITATIVE_ONLY``) workflow;
5. ``provenance_required``: an authoritative variant without at least one
   ``provenance.oracle_records`` entry;
6. ``forbidden_marker``: narrative text carrying a soft-authority marker (the
   envelope's own ``policy.forbidden_markers`` plus the configured ones), in
   every workflow;
7. ``narrative_policy_violation``: narrative text that does not follow its
   ``grammar_mode`` (attributive / hedged / educational) or carries precise
   numbers under ``max_specificity = "general"``.

``scrub_measurements`` strips numbers with units from narrative text before
delivery. The principal's surface receives an ``authorization`` item: the
accepted envelope, or for a refusal a ``refusal`` variant with code
``BLOCKED`` / ``POLICY_VIOLATION`` and a user message that carries no
control-plane detail (no oracle, threshold or workflow internals) and an
opaque ``audit_id``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from subjects.wire import Detail

# ---------------------------------------------------------------------------
# RFC-0010 types (spec 001 "Supporting Types"), tag field ``kind``
# ---------------------------------------------------------------------------

Text = Annotated[str, Meta(min_length=1, max_length=4000)]
Id = Annotated[str, Meta(min_length=1, max_length=256)]


class Provenance(Struct, omit_defaults=True):
    """Authoritative basis of a claim; at least one oracle record (checked with its own code)."""

    oracle_records: Annotated[list[dict[str, Any]], Meta(max_length=64)]
    generated_at: Annotated[str, Meta(min_length=1, max_length=64)]
    envelope_id: Id
    derived_from: list[Id] | None = None


class NarrativePolicy(Struct):
    grammar_mode: Literal["attributive", "hedged", "educational"]
    forbidden_markers: Annotated[list[Annotated[str, Meta(max_length=200)]], Meta(max_length=256)]
    max_specificity: Literal["general", "contextualized"]
    scrub_measurements: bool


class RefusalReason(Struct, omit_defaults=True):
    code: Literal["BLOCKED", "UNRESOLVABLE", "POLICY_VIOLATION", "EMERGENCY_ESCALATION"]
    user_message: Text
    audit_id: Id
    recovery_hint: Text | None = None


class OracleReading(Struct):
    oracle_id: Id
    tier: Literal["primary", "secondary", "cross_domain", "unverified"]
    value: Any
    verified_at: Annotated[str, Meta(max_length=64)]


class OracleConflict(Struct):
    axis: Id
    oracles: Annotated[list[OracleReading], Meta(max_length=64)]
    resolution_attempted: bool
    escalation_required: bool


class Measurement(Struct, tag_field="kind", tag="measurement"):
    value: float
    provenance: Provenance


class Classification(Struct, tag_field="kind", tag="classification"):
    label: Text
    provenance: Provenance


class Action(Struct, tag_field="kind", tag="action", omit_defaults=True):
    action: Text
    provenance: Provenance
    params: dict[str, Any] | None = None


class Narrative(Struct, tag_field="kind", tag="narrative"):
    text: Text
    policy: NarrativePolicy


class Refusal(Struct, tag_field="kind", tag="refusal"):
    reason: RefusalReason


class DisputeSummary(Struct, tag_field="kind", tag="dispute_summary"):
    sources: Annotated[list[OracleConflict], Meta(min_length=1, max_length=64)]


AuthorizationEnvelope = Measurement | Classification | Action | Narrative | Refusal | DisputeSummary
KINDS = ("measurement", "classification", "action", "narrative", "refusal", "dispute_summary")
AUTHORITATIVE = ("measurement", "classification", "action")


class AuthorizationEnvelopePayload(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Payload of ``vendor.pgw.authorization`` as published in the capability document."""

    workflow_id: Annotated[str, Meta(min_length=1, max_length=128)]
    envelope: AuthorizationEnvelope
    principal: Annotated[str, Meta(min_length=1, max_length=65)] | None = None


# ---------------------------------------------------------------------------
# Policy
# ---------------------------------------------------------------------------

_UNITS = (
    r"%|percent|per ?cent|mg/dl|mmol/l|mg|mcg|µg|μg|kg|g|lbs?|oz|ml|l|mmhg|bpm|°[cf]?|degrees?|kcal|cal|iu|units?"
    r"|mm|cm|m|km|mi|miles?|ft|inch(?:es)?|sec(?:onds?)?|ms|min(?:utes?)?|hrs?|hours?|days?|weeks?|months?|years?"
    r"|kb|mb|gb|tb|hz|khz|mhz|ghz|kw|kwh|ma|psi|kpa|ppm|usd|eur"
)
MEASUREMENT = re.compile(
    r"(?:[$€£]\s?\d[\d,]*(?:\.\d+)?)|(?:\b\d[\d,]*(?:\.\d+)?\s?(?:" + _UNITS + r")(?![A-Za-z]))",
    re.IGNORECASE,
)
_NUMBER = re.compile(r"\d")
_ATTRIBUTION = re.compile(
    r"\b(?:according to|as reported by|reported by|reports?|says|said|states?|stated|notes?|noted"
    r"|per the|cites?|cited|writes?|wrote|claims?|claimed|suggests?|indicates?|source[sd]?)\b",
    re.IGNORECASE,
)
_HEDGE = re.compile(
    r"\b(?:may|might|could|possibly|perhaps|likely|unlikely|appears?|seems?|suggests?|tends? to|often|in some cases"
    r"|generally|typically|it is possible)\b",
    re.IGNORECASE,
)
_DIRECTIVE = re.compile(
    r"\b(?:you should|you must|you need to|you have to|your (?:result|diagnosis|dose|account|case) (?:is|shows)"
    r"|take \d|i recommend|we recommend|do not take|stop taking)\b",
    re.IGNORECASE,
)


def has_marker(text: str, markers: list[str]) -> str | None:
    """The first forbidden marker ``text`` carries, matched as whole words, case-insensitive."""
    import unicodedata

    t = unicodedata.normalize("NFKC", text).casefold()
    for m in markers:
        m2 = unicodedata.normalize("NFKC", m).casefold().strip()
        if m2 and re.search(r"(?<!\w)" + re.escape(m2) + r"(?!\w)", t):
            return m
    return None


def scrub_measurements(text: str) -> str:
    return MEASUREMENT.sub("[measurement removed]", text)


class PolicyRefusal(Exception):
    def __init__(self, code: str, reason: str, path: str, user_code: str = "POLICY_VIOLATION") -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.path = path
        self.user_code = user_code

    @property
    def detail(self) -> Detail:
        return Detail(message=self.reason, path=self.path, rule=self.code)


def decode(raw: Any) -> AuthorizationEnvelope:
    """The typed variant; an unknown ``kind`` fails closed (spec 001)."""
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if kind not in KINDS:
        shown = kind[:64] if isinstance(kind, str) else type(kind).__name__
        raise PolicyRefusal(
            "unknown_authorization_kind",
            f"authorization kind {shown!r} is not one of {', '.join(KINDS)}; unknown kinds are BLOCKED (spec 001)",
            "$.payload.envelope.kind",
            user_code="BLOCKED",
        )
    try:
        return msgspec.convert(raw, AuthorizationEnvelope)
    except msgspec.ValidationError as e:
        msg = str(e)
        where = msg.rsplit("at `", 1)[-1].rstrip("`").replace("$", "$.payload.envelope", 1) if "at `" in msg else "$.payload.envelope"
        raise PolicyRefusal("envelope_invalid", f"the {kind} envelope does not match spec 001: {msg}", where, "BLOCKED") from None


def enforce(env: AuthorizationEnvelope, workflow: Any, narrative_cfg: Any, *, untrusted: bool = False) -> AuthorizationEnvelope:
    """Apply spec 001; return the envelope to deliver (narrative possibly scrubbed)."""
    kind = env.__struct_config__.tag
    if untrusted and kind in AUTHORITATIVE:
        # spec 002 "Trust boundary": untrusted content never grants authority.
        raise PolicyRefusal(
            "untrusted_content_blocks_approval",
            f"a {kind} envelope grants authority; this one carries untrusted content (spec 002 Trust boundary)",
            "$.meta.contentTrust",
        )
    non_auth = workflow.authoritative_intent == "non_authoritative" or workflow.enforcement_mode == "NON_AUTHORITATIVE_ONLY"
    if kind in AUTHORITATIVE:
        if non_auth:
            raise PolicyRefusal(
                "authority_not_permitted",
                f"a {kind} envelope is authoritative; this workflow declares non_authoritative intent (spec 001)",
                "$.payload.envelope.kind",
            )
        if not env.provenance.oracle_records:  # type: ignore[union-attr]
            raise PolicyRefusal(
                "provenance_required",
                f"a {kind} envelope needs provenance.oracle_records with at least one record (spec 001)",
                "$.payload.envelope.provenance.oracle_records",
            )
    if isinstance(env, Narrative):
        markers = [*narrative_cfg.forbidden_markers, *env.policy.forbidden_markers]
        hit = has_marker(env.text, markers)
        if hit:
            raise PolicyRefusal(
                "forbidden_marker",
                f"the narrative carries the soft-authority marker {hit!r} (spec 001 forbidden markers)",
                "$.payload.envelope.text",
            )
        text = scrub_measurements(env.text) if env.policy.scrub_measurements else env.text
        if narrative_cfg.enforce_grammar_mode:
            mode = env.policy.grammar_mode
            bad = (
                (mode == "attributive" and not _ATTRIBUTION.search(text))
                or (mode == "hedged" and not _HEDGE.search(text))
                or (mode == "educational" and _DIRECTIVE.search(text))
            )
            if bad:
                raise PolicyRefusal(
                    "narrative_policy_violation",
                    {
                        "attributive": "an attributive narrative must attribute its claims to a source",
                        "hedged": "a hedged narrative must hedge its claims",
                        "educational": "an educational narrative must not direct the reader's own case",
                    }[mode],
                    "$.payload.envelope.text",
                )
            if env.policy.max_specificity == "general" and not env.policy.scrub_measurements and MEASUREMENT.search(text):
                raise PolicyRefusal(
                    "narrative_policy_violation",
                    "max_specificity 'general' forbids precise measurements; scrub them or use 'contextualized'",
                    "$.payload.envelope.text",
                )
        if text != env.text:
            env = Narrative(text=text, policy=env.policy)
    return env


USER_MESSAGES = {
    "BLOCKED": "This item could not be shown because its format is not recognised. Nothing was authorised.",
    "POLICY_VIOLATION": "This item was withheld because it did not meet the policy that applies here. Nothing was authorised.",
}


def user_refusal(code: str, audit_id: str) -> Refusal:
    """A refusal variant a user may see: no control-plane detail (spec 001 RefusalReason)."""
    user_code: Literal["BLOCKED", "POLICY_VIOLATION"] = "BLOCKED" if code == "BLOCKED" else "POLICY_VIOLATION"
    return Refusal(reason=RefusalReason(
        code=user_code,
        user_message=USER_MESSAGES[user_code],
        audit_id=audit_id,
        recovery_hint="Ask the agent to send it again in a supported form." if user_code == "BLOCKED" else None,
    ))

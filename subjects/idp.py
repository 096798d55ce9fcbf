"""Wire types of the IDP kernel (spec 003, DESIGN §5): the bus side of the contract.

* ``IdpStandard`` / ``IdpThin``: the IDP record of spec 003 §4.1-§4.2 and the
  IDP_THIN profile of §7. ``decode_idp`` picks the profile from ``profile``
  and validates every field rule that a Struct can express; the rules a
  Struct cannot (a timestamp that is RFC 3339 *and* UTC and a real date,
  ``MISSION_STAGE`` needing ``mission_ref``) are checked in ``__post_init__``
  so they surface as the same ``msgspec.ValidationError`` with a path.
* ``TransitionRequest`` on ``agent.{agent}.idp`` and ``TransitionReport`` on
  ``agent.{agent}.transition``.
* Kernel results, tagged on ``result`` (spec 003 §5.1 step 5 and §6):
  ``PERMIT``, ``DENY`` (the Enriched DENY of §6.1), ``REJECT`` (§5.2 codes),
  ``HEM_PENDING``.
* ``LogEvent``: one signed, hash-chained entry of the event log
  (``log.{EVENT}``, stream ``PGW_EVENTLOG``) and its canonical form, so that
  any party can verify the log with ``subjects`` alone.

JSON Schemas come from the same Structs (``idp_json_schemas()``).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import re
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from subjects.wire import Detail, ReportedEffect

# ---------------------------------------------------------------------------
# Constraints, each written once (STYLE.md "Wire types")
# ---------------------------------------------------------------------------

_UUID4 = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-4[0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}$"
_UUID = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
# spec 003 §4.1 "ISO 8601 UTC"; we accept the RFC 3339 profile with Z or +00:00.
_RFC3339_UTC = r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|\+00:00)$"

# spec 003 §4.2: idp_id, goal_id and so_id are UUID v4.
UuidV4 = Annotated[str, Meta(pattern=_UUID4, description="UUID v4 (RFC 4122)")]
# spec 003 §4.1: mission_ref and context_refs are UUIDs (no version stated).
Uuid = Annotated[str, Meta(pattern=_UUID, description="UUID (RFC 4122)")]
UtcTimestamp = Annotated[str, Meta(pattern=_RFC3339_UTC, description="RFC 3339 timestamp in UTC")]
SessionId = Annotated[str, Meta(min_length=1, max_length=128)]
MandateId = Annotated[str, Meta(min_length=1, max_length=256)]
# A Cedar action id: printable, no quotes or backslashes (it is embedded in Action::"...").
CedarAction = Annotated[str, Meta(pattern=r'^[^"\\\x00-\x1f]{1,256}$', description="Cedar action id")]
StepSequence = Annotated[int, Meta(ge=1, le=2**53 - 1)]
# spec 003 §4.2 maximum lengths.
GoalText = Annotated[str, Meta(min_length=1, max_length=500)]
ReasoningText = Annotated[str, Meta(min_length=1, max_length=1000)]
# spec 003 §4.3: unknown types are recorded, never rejected; so any short string.
ReasoningType = Annotated[str, Meta(min_length=1, max_length=256)]
Confidence = Annotated[float, Meta(ge=0.0, le=1.0)]
HemUrgency = Literal["NONE", "RECOMMENDED", "REQUIRED"]

# spec 003 §11 Table 1.
REASONING_BASIS_TYPES = frozenset(
    {"RULE_BASED", "INFERENCE", "INSTRUCTION", "UNCERTAINTY_REDUCTION", "MISSION_STAGE"}
)

# REJECT codes (spec 003 §5.2, §7, §11 Table 2) plus the mandate and request
# codes of DESIGN §5.2 that the draft leaves to the implementation.
RejectCode = Literal[
    "REQUEST_MALFORMED",
    "IDP_MISSING",
    "IDP_MALFORMED",
    "IDP_DUPLICATE",
    "MANDATE_INVALID",
    "MANDATE_EXPIRED",
    "MANDATE_REVOKED",
    "IDP_SO_MISMATCH",
    "IDP_MANDATE_MISMATCH",
    "IDP_STEP_SEQUENCE",
    "IDP_THIN_NOT_ACCEPTED",
    "SESSION_TERMINATED",
    "KERNEL_UNAVAILABLE",
]
# spec 003 §6.2 deny codes.
DenyCode = Literal[
    "POLICY_DENY",
    "MANDATE_SCOPE",
    "SO_STATE_INVALID",
    "HEM_PENDING",
    "MANDATE_REVOKED",
    "CROSS_PRINCIPAL_UNRESOLVED",
    "MISSION_INVALID",
    "IDP_MISSION_REF_MISMATCH",
    # Extensions (docs/kernel.md "Codes beyond spec 003 §11"):
    "GATE_REQUIRED",  # §8.7: the action must transit a kernel gate, and none exists
    "HEM_UNAVAILABLE",  # §4.4 hem_urgency REQUIRED while HEM is switched off
]


def _check_utc(value: str, path: str) -> None:
    try:
        dt = datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
    except ValueError as e:
        raise ValueError(f"`{path}` is not a valid timestamp: {e}") from None
    if dt.utcoffset() is None or dt.utcoffset().total_seconds() != 0:  # type: ignore[union-attr]
        raise ValueError(f"`{path}` must be in UTC")


# ---------------------------------------------------------------------------
# The IDP record (spec 003 §4.1, §7)
# ---------------------------------------------------------------------------


class DeclaredGoal(Struct, forbid_unknown_fields=True):
    """spec 003 §4.2 declared_goal: goal_id (UUID v4) and a description of at most 500 chars."""

    goal_id: UuidV4
    description: GoalText


class ReasoningBasis(Struct, forbid_unknown_fields=True):
    """spec 003 §4.2-§4.3 reasoning_basis: a type and a description of at most 1000 chars."""

    type: ReasoningType
    description: ReasoningText


class _IdpCommon(Struct, kw_only=True, omit_defaults=True):
    idp_id: UuidV4
    session_id: SessionId
    so_id: UuidV4
    mandate_id: MandateId
    step_sequence: StepSequence
    requested_action: CedarAction
    timestamp: UtcTimestamp
    mission_ref: Uuid | None = None
    context_refs: Annotated[list[Uuid], Meta(max_length=256)] | None = None
    audit_accessible: bool = True
    metadata: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_utc(self.timestamp, "timestamp")


class IdpStandard(_IdpCommon, kw_only=True, omit_defaults=True):
    """IDP_STANDARD (spec 003 §4.1, §4.5): every REQUIRED field present."""

    declared_goal: DeclaredGoal
    reasoning_basis: ReasoningBasis
    confidence_level: Confidence
    hem_urgency: HemUrgency
    # Absent in IDP_STANDARD (spec 003 §7); tolerated when it says so explicitly.
    profile: Literal["IDP_STANDARD"] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        # spec 003 §4.3 MISSION_STAGE: "The mission_ref field MUST be present".
        if self.reasoning_basis.type == "MISSION_STAGE" and self.mission_ref is None:
            raise ValueError("`mission_ref` is required when reasoning_basis.type is MISSION_STAGE")


class IdpThin(_IdpCommon, kw_only=True, omit_defaults=True):
    """IDP_THIN (spec 003 §7): reasoning fields optional; the kernel records stubs."""

    profile: Literal["IDP_THIN"]
    declared_goal: DeclaredGoal | None = None
    reasoning_basis: ReasoningBasis | None = None
    confidence_level: Confidence | None = None
    hem_urgency: HemUrgency | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            self.reasoning_basis is not None
            and self.reasoning_basis.type == "MISSION_STAGE"
            and self.mission_ref is None
        ):
            raise ValueError("`mission_ref` is required when reasoning_basis.type is MISSION_STAGE")


Idp = IdpStandard | IdpThin


def decode_idp(raw: Any) -> Idp:
    """Validate a decoded JSON object as an IDP of its profile.

    Raises ``msgspec.ValidationError`` (message names the path) when any
    field rule of spec 003 §4.1-§4.2 / §7 is broken.
    """
    if not isinstance(raw, dict):
        raise msgspec.ValidationError("Expected `object`, got `" + type(raw).__name__ + "`")
    if raw.get("profile") == "IDP_THIN":
        return msgspec.convert(raw, IdpThin)
    return msgspec.convert(raw, IdpStandard)


def profile_of(idp: Idp) -> Literal["IDP_STANDARD", "IDP_THIN"]:
    return "IDP_THIN" if isinstance(idp, IdpThin) else "IDP_STANDARD"


# ---------------------------------------------------------------------------
# Requests and reports (DESIGN §5.1, §5.4)
# ---------------------------------------------------------------------------


class TransitionRequest(Struct, kw_only=True, omit_defaults=True):
    """Body on ``agent.{agent}.idp``: the kernel.transition() call of spec 003 §5.1."""

    mandate: str | None = None
    action: str | None = None
    resource: str | None = None
    idp: Any = None


class TransitionReport(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Body on ``agent.{agent}.transition``: what the agent says it executed (DESIGN §5.4)."""

    idp_id: UuidV4
    executed_action: Annotated[str, Meta(min_length=1, max_length=256)]
    effect: ReportedEffect


# ---------------------------------------------------------------------------
# Kernel results (spec 003 §5.1 step 5, §6), tagged on "result"
# ---------------------------------------------------------------------------


class MismatchDetail(Struct):
    """spec 003 §6.2 mismatch_detail."""

    expected_mission_ref: str
    submitted_mission_ref: str


class SuggestedPath(Struct):
    """spec 003 §6.2 suggested_paths entry."""

    path_id: str
    steps: list[str]
    requires_elevation: bool


class KernelResultBase(Struct, tag_field="result", kw_only=True, omit_defaults=True):
    timestamp: str


class Permit(KernelResultBase, tag="PERMIT"):
    """Cedar permitted the transition; the IDP_SUBMITTED event is at ``event_seq``."""

    idp_id: str
    session_id: str
    step_sequence: int
    event_seq: int
    warnings: list[Detail] = field(default_factory=list)


class Reject(KernelResultBase, tag="REJECT"):
    """spec 003 §5.2: the IDP or mandate failed validation; nothing was evaluated."""

    error_code: RejectCode
    reason: str
    details: list[Detail] = field(default_factory=list)
    idp_id: str | None = None


class EnrichedDeny(KernelResultBase, tag="DENY"):
    """spec 003 §6.1 Enriched DENY Response. ``deny_reason`` never quotes policy text (§8.3)."""

    deny_code: DenyCode
    deny_reason: str
    idp_received: dict[str, Any] | None
    available_actions: list[str]
    hem_available: bool
    suggested_paths: list[SuggestedPath] | None = None
    mismatch_detail: MismatchDetail | None = None
    idp_id: str | None = None
    event_seq: int | None = None


class HemPending(KernelResultBase, tag="HEM_PENDING"):
    """The session is in HEM_PENDING; the answer arrives as a ``hem_decision`` outcome."""

    idp_id: str
    session_id: str
    moment_id: str
    trigger: Literal["HEM_URGENCY_REQUIRED", "MISSION_REF_MISMATCH_THRESHOLD", "IDP_COMMITMENT_GAP"]
    event_seq: int | None = None


KernelResult = Permit | Reject | EnrichedDeny | HemPending

kernel_result_decoder = msgspec.json.Decoder(KernelResult)


# ---------------------------------------------------------------------------
# The event log (spec 003 §5.3, §5.5, §8.2; DESIGN §2 log.{event})
# ---------------------------------------------------------------------------

EVENT_TYPES = (
    "IDP_SUBMITTED",
    "IDP_SUBMISSION_VOIDED",
    "IDP_MISSION_REF_MISMATCH_REJECTED",
    "CEDAR_PERMIT_RECORDED",
    "CEDAR_DENY_RECORDED",
    "HEM_ESCALATED",
    "HEM_RESOLVED",
    "STATE_TRANSITIONED",
    "IDP_COMMITMENT_VERIFIED",
    "IDP_COMMITMENT_GAP",
    "TRANSITION_REFUSED",
    "IDP_RECEIVED",  # a valid IDP its session does not admit (gateway/kernel/received.py)
    "TRANSITION_REPORT_OVERDUE",  # a permit closed without its report (gateway/kernel/overdue.py)
    "MANDATE_REVOKED",  # live revocation (gateway/kernel/revocation.py)
    "AUDIT_QUERY",  # an Audit Principal's query and what it was shown (gateway/kernel/audit.py)
    "GATE_DISPATCHED",  # the kernel sent a gated action to its executor (gateway/kernel/gate.py)
    "LOG_RECORD_QUARANTINED",  # an operator marked a record as not the kernel's own (gateway/kernel/eventlog.py)
)

GENESIS_DIGEST = "0" * 64


class LogEvent(Struct, kw_only=True):
    """One kernel event: signed (Ed25519, ``kid``) and chained to its predecessor.

    ``prev_seq``/``prev_digest`` are the stream sequence and digest of the
    event before it in ``PGW_EVENTLOG`` (``0`` / 64 zeros for the first), so the
    stream is one hash chain. ``sig`` is the base64url Ed25519 signature over
    ``signing_bytes()``: the RFC 8785 (JCS) serialization of every member but
    ``sig``. ``digest()`` is SHA-256 over the JCS of the whole event.
    """

    event_id: str
    event_type: str
    ts: str
    prev_seq: int
    prev_digest: str
    kid: str
    body: dict[str, Any]
    sig: str = ""

    def _dict(self, with_sig: bool) -> dict[str, Any]:
        d = msgspec.to_builtins(self)
        if not with_sig:
            d.pop("sig", None)
        return d

    def signing_bytes(self) -> bytes:
        import rfc8785

        return rfc8785.dumps(self._dict(False))

    def canonical_bytes(self) -> bytes:
        """The wire form: JCS of the whole event (so re-serialization is stable)."""
        import rfc8785

        return rfc8785.dumps(self._dict(True))

    def digest(self) -> str:
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    @property
    def signature(self) -> bytes:
        return base64.urlsafe_b64decode(self.sig + "=" * (-len(self.sig) % 4))


log_event_decoder = msgspec.json.Decoder(LogEvent)


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def json_digest(value: Any) -> str:
    """spec 004 JSON-DIGEST: lowercase hex SHA-256 of JCS after absent-field normalization."""
    import rfc8785

    def norm(v: Any) -> Any:
        if isinstance(v, dict):
            out = {k: norm(x) for k, x in v.items()}
            return {k: x for k, x in out.items() if x is not None and x not in ([], {})}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v

    return hashlib.sha256(rfc8785.dumps(norm(value))).hexdigest()


# ---------------------------------------------------------------------------
# PII markers (spec 003 §9): obvious e-mail addresses, phone numbers and names
# ---------------------------------------------------------------------------

_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+")
# An international or grouped phone number: 7-15 digits with separators,
# optionally '+'-prefixed. Bare UUID fragments and ISO dates do not match.
_PHONE = re.compile(r"(?<![\w-])(\+\d{1,3}[\s.-]?)?(\(\d{1,4}\)[\s.-]?)?\d{2,4}([\s.-]\d{2,4}){2,4}(?![\w-])")
# A personal title before a capitalised word ("Mr Smith", "Dr. Jane Doe"): a name
# whatever the configured list holds.
_TITLED_NAME = re.compile(r"\b(?:Mr|Mrs|Ms|Miss|Mx|Dr|Prof|Sir|Dame|Madam|Herr|Frau|Mme|Mlle)\.?\s+[A-Z][\w'’-]+")


@functools.lru_cache(maxsize=8)
def _names_re(names: tuple[str, ...]) -> re.Pattern[str] | None:
    words = sorted({" ".join(n.split()) for n in names if n.strip()}, key=len, reverse=True)
    if not words:
        return None
    alt = "|".join(r"\s+".join(re.escape(w) for w in n.split()) for n in words)
    return re.compile(rf"(?<!\w)(?:{alt})(?!\w)", re.IGNORECASE)


def pii_markers(text: str, names: tuple[str, ...] = ()) -> list[str]:
    """Kinds of obvious PII found in ``text`` (``email``, ``phone``, ``name``); never the values.

    ``names``: names to flag (``kernel.pii_names``), matched case-insensitively
    as whole words; a titled name ("Mr Smith") is flagged without a list.
    """
    found = []
    if _EMAIL.search(text):
        found.append("email")
    for m in _PHONE.finditer(text):
        digits = sum(c.isdigit() for c in m.group(0))
        if 7 <= digits <= 15 and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", m.group(0).strip()):
            found.append("phone")
            break
    listed = _names_re(tuple(names))
    if _TITLED_NAME.search(text) or (listed is not None and listed.search(text)):
        found.append("name")
    return found


def idp_json_schemas() -> dict[str, Any]:
    """JSON Schemas of the IDP kernel's wire types, generated from the Structs."""
    (schemas, components) = msgspec.json.schema_components(
        [IdpStandard, IdpThin, TransitionRequest, TransitionReport, KernelResult, LogEvent],
        ref_template="#/$defs/{name}",
    )
    names = ["IdpStandard", "IdpThin", "TransitionRequest", "TransitionReport", "KernelResult", "LogEvent"]
    return {"$defs": components, **{n: s for n, s in zip(names, schemas, strict=True)}}


def now_utc() -> datetime:
    return datetime.now(UTC)


# Picked up by ``pgw schema`` (subjects.schemas.EXTRA_MODULES).
WIRE_TYPES: dict[str, Any] = {
    "IdpStandard": IdpStandard,
    "IdpThin": IdpThin,
    "TransitionRequest": TransitionRequest,
    "TransitionReport": TransitionReport,
    "KernelResult": KernelResult,
    "LogEvent": LogEvent,
}


def canonical_id(value: str) -> str:
    """An IDP id as the kernel keys it: a UUID in its lower-case hyphenated form (spec 003 §4.2
    gives UUIDs, whose hex digits are case-insensitive), anything else as written. Applied once
    where an IDP or a report enters the kernel, and by a client matching the results it gets back, so its events, the audit walk and ``restrictions`` name one id."""
    if len(value) == 36 and value.count("-") == 4:
        with contextlib.suppress(ValueError):
            return str(uuid.UUID(value))
    return value
